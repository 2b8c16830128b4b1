"""The reasoning and tool-call parsers on text a model would write: the right split, and the
same split however the text is cut into streamed deltas (hypothesis picks the cuts)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.entrypoints.openai.protocol import ToolCall
from sluice.entrypoints.openai.reasoning import Qwen3ReasoningParser, partial_tag_suffix
from sluice.entrypoints.openai.tool_parsers import HermesToolParser

pytestmark = pytest.mark.serial


def cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def reason(deltas: list[str], prompt_opens: bool = False) -> tuple[str, str]:
    parser = Qwen3ReasoningParser(prompt_opens)
    reasoning = content = ""
    for delta in deltas:
        out = parser.feed(delta)
        reasoning += out.reasoning
        content += out.content
    out = parser.finish()
    return reasoning + out.reasoning, content + out.content


def call_tools(deltas: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    parser = HermesToolParser()
    content = ""
    calls: list[ToolCall] = []
    for delta in deltas:
        out = parser.feed(delta)
        content += out.content
        calls += out.calls
    out = parser.finish()
    content += out.content
    calls += out.calls
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in calls)
    assert len({call.id for call in calls}) == len(calls)
    return content, [(call.function.name, json.loads(call.function.arguments)) for call in calls]


QWEN3_THINKING = ("<think>\nThe user greets me. I should greet back.\n</think>\n\n"
                  "Hello! How can I help you today?")

REASONING_CASES = [
    # (reply, prompt opens a <think>, reasoning, content)
    (QWEN3_THINKING, False, "\nThe user greets me. I should greet back.\n",
     "\n\nHello! How can I help you today?"),
    ("Hello there.", False, "", "Hello there."),  # enable_thinking false: no tags
    ("<think>\nStill thinking when max_tokens hit", False,
     "\nStill thinking when max_tokens hit", ""),
    ("I reason here</think>The answer is 4.", True, "I reason here", "The answer is 4."),
    ("<thin", False, "", "<thin"),  # a reply cut inside a would-be tag is text
    ("x </think> y", False, "", "x </think> y"),  # </think> without <think> is text
    ("<think></think>", False, "", ""),
    ("<think>a<b</thinkc</think>d<think>e", False, "a<b</thinkc", "d<think>e"),
]


@pytest.mark.parametrize(("reply", "prompt_opens", "reasoning", "content"), REASONING_CASES)
def test_qwen3_reasoning_split(reply: str, prompt_opens: bool, reasoning: str,
                               content: str) -> None:
    assert reason([reply], prompt_opens) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(REASONING_CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_qwen3_reasoning_is_the_same_however_it_streams(case: tuple, cuts: list[int]) -> None:
    reply, prompt_opens, reasoning, content = case
    assert reason(cut(reply, cuts), prompt_opens) == (reasoning, content)


def test_prompt_opens_reasoning() -> None:
    assert Qwen3ReasoningParser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not Qwen3ReasoningParser.prompt_opens_reasoning(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not Qwen3ReasoningParser.prompt_opens_reasoning("<|im_start|>assistant\n")


def test_partial_tag_suffix() -> None:
    assert partial_tag_suffix("abc</th", "</think>") == 4
    assert partial_tag_suffix("abc<", "</think>") == 1
    assert partial_tag_suffix("abc</think>", "</think>") == 0  # whole tags are not held
    assert partial_tag_suffix("", "</think>") == 0


WEATHER = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
           '"unit": "celsius"}}\n</tool_call>')
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'

TOOL_CASES = [
    # (reply, content, calls)
    (WEATHER, "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("Let me check the weather.\n" + WEATHER, "Let me check the weather.",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (WEATHER + "\n" + TIME + "\n", "",
     [("get_weather", {"city": "Paris", "unit": "celsius"}),
      ("get_time", {"tz": "Europe/Paris"})]),
    ("No tools needed: 2 + 2 = 4.\n", "No tools needed: 2 + 2 = 4.\n", []),
    # EOS right after the JSON (the closing tag never came): still a call.
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    # Not a call: the text stays, tags and all.
    ("Here:\n<tool_call>\nnot json\n</tool_call> done",
     "Here:\n<tool_call>\nnot json\n</tool_call> done", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("Cut off <tool_ca", "Cut off <tool_ca", []),
    ('<tool_call>\n{"name": "f", "arguments": {"q": "é ✓ </tool_call"}}\n</tool_call>', "",
     [("f", {"q": "é ✓ </tool_call"})]),
    ("  \n", "  \n", []),
    (WEATHER + "\nAnd that is all.", "\nAnd that is all.",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
]


@pytest.mark.parametrize(("reply", "content", "calls"), TOOL_CASES)
def test_hermes_tool_calls(reply: str, content: str, calls: list) -> None:
    assert call_tools([reply]) == (content, calls)


@settings(max_examples=400, deadline=None)
@given(case=st.sampled_from(TOOL_CASES), cuts=st.lists(st.integers(0, 300), max_size=16))
def test_hermes_tool_calls_are_the_same_however_they_stream(case: tuple,
                                                            cuts: list[int]) -> None:
    reply, content, calls = case
    assert call_tools(cut(reply, cuts)) == (content, calls)


def test_hermes_arguments_keep_the_models_values() -> None:
    parser = HermesToolParser()
    out = parser.feed('<tool_call>{"name": "f", "arguments": {"n": 1.5, "ok": true, '
                      '"list": [1, "二"]}}</tool_call>')
    assert out.calls[0].function.arguments == '{"n": 1.5, "ok": true, "list": [1, "二"]}'
    # Arguments given as a JSON string are passed on as that string.
    out = HermesToolParser().feed('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}'
                                  "</tool_call>")
    assert out.calls[0].function.arguments == '{"a": 1}'
