"""The reasoning and tool-call parsers on text a model would write: the right split, and the
same split however the text is cut into streamed deltas (hypothesis picks the cuts)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.entrypoints.openai.protocol import ToolCall
from sluice.entrypoints.openai.reasoning import Qwen3ReasoningParser, partial_tag_suffix
from sluice.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    SmolLM2ToolParser,
    ToolParser,
)

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


def call_tools(deltas: list[str], parser_class: type[ToolParser] = HermesToolParser,
               truncated: bool = False) -> tuple[str, list[tuple[str, dict]]]:
    parser = parser_class()
    content = ""
    calls: list[ToolCall] = []
    for delta in deltas:
        out = parser.feed(delta)
        content += out.content
        calls += out.calls
    out = parser.finish(truncated)
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
    # A block cut off mid-call (max_tokens): no half call shown as content.
    ("Checking.\n" + WEATHER + '\n<tool_call>\n{"name": "get_weather", "argu', "Checking.",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # SmolLM2's form: a list of calls in one block.
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]</tool_call>', "",
     [("get_weather", {"city": "Paris", "unit": "celsius"}),
      ("get_time", {"tz": "Europe/Paris"})]),
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


# Each family's format, as its reference code writes an assistant turn with calls:
# SmolLM2 (APIGen's format, the template sluice ships for it), Llama 3.1 JSON tool calling
# (`<|python_tag|>` + {"name", "parameters"}, several joined by "; "), Llama 3.2 / 4 Python
# lists, Mistral's tokenizer v3 (`[TOOL_CALLS]` + a JSON list) and v11+ (`[TOOL_CALLS]name[ARGS]`
# + the arguments, per call).
FAMILY_CASES = [
    # (parser, reply, content, calls)
    (SmolLM2ToolParser, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
     "</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    (SmolLM2ToolParser, "The weather is sunny.", "The weather is sunny.", []),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "get_weather", "parameters": '
     '{"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "UTC; GMT"}}', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC; GMT"})]),
    (Llama3JsonToolParser, "Paris is sunny today.", "Paris is sunny today.", []),
    (Llama3JsonToolParser, "{not a call} but text", "{not a call} but text", []),
    (PythonicToolParser, '[get_weather(city="Paris"), get_time(tz="UTC", hours=[1, 2])]', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC", "hours": [1, 2]})]),
    (PythonicToolParser, '<|python_start|>[get_weather(city="Paris")]<|python_end|>', "",
     [("get_weather", {"city": "Paris"})]),
    (PythonicToolParser, "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    (PythonicToolParser, "[os.system(cmd=__import__('os'))]",
     "[os.system(cmd=__import__('os'))]", []),  # not a literal: never evaluated, no call
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {}}]', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time'
     '[ARGS]{}', "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (MistralToolParser, 'Let me look. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     "Let me look.", [("get_weather", {"city": "Paris"})]),
    (MistralToolParser, "No calls here.", "No calls here.", []),
]


@pytest.mark.parametrize(("parser", "reply", "content", "calls"), FAMILY_CASES)
def test_family_tool_calls(parser: type[ToolParser], reply: str, content: str,
                           calls: list) -> None:
    assert call_tools([reply], parser) == (content, calls)


@settings(max_examples=400, deadline=None)
@given(case=st.sampled_from(FAMILY_CASES), cuts=st.lists(st.integers(0, 300), max_size=16))
def test_family_tool_calls_are_the_same_however_they_stream(case: tuple,
                                                            cuts: list[int]) -> None:
    parser, reply, content, calls = case
    assert call_tools(cut(reply, cuts), parser) == (content, calls)


@pytest.mark.parametrize(("parser", "reply"), [
    (HermesToolParser, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'),
    (SmolLM2ToolParser, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Par'),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Par'),
    (PythonicToolParser, '[get_weather(city="Par'),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci'),
])
def test_a_call_cut_off_at_max_tokens_is_never_content(parser: type[ToolParser],
                                                       reply: str) -> None:
    content, calls = call_tools([reply], parser, truncated=True)
    assert calls == [] and "get_weather" not in content
    assert content in ("", "Sure.")
