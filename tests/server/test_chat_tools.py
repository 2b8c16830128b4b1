"""Tool calling and reasoning through `sluice serve --enable-auto-tool-choice --tool-call-parser
hermes --reasoning-parser qwen3`, with the real openai client, on the tiny model with Qwen3's
chat template (tests/server/conftest.py). Its replies are gibberish, so these tests check what
reaches the template and the shape of replies; the parsers on model-like text are
tests/server/test_parsers.py's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from transformers import AutoTokenizer

from sluice import LLM, SamplingParams
from sluice.entrypoints.openai.protocol import ChatCompletionStreamResponse
from sluice.entrypoints.openai.reasoning import Qwen3ReasoningParser
from sluice.entrypoints.openai.serving_chat import _Parsing, _Reply
from sluice.entrypoints.openai.tool_parsers import HermesToolParser
from tests.server.conftest import ServerProcess, launch_server
from tests.server.test_server_errors import assert_error

pytestmark = pytest.mark.serial

MODEL = "qwen-like"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
HISTORY = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


@pytest.fixture(scope="module")
def tool_server(tool_model_dir: str, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    started = launch_server(tool_model_dir, tmp_path_factory.mktemp("tools") / "server.log",
                            "--served-model-name", MODEL, "--enable-auto-tool-choice",
                            "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield started
    assert started.stop() == 0


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def expected_prompt(model_dir: str, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The prompt transformers renders, tool-call arguments as objects (as templates take)."""
    conversation = json.loads(json.dumps(messages))
    for message in conversation:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if message.get("content") is None:
            message["content"] = ""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                              tokenize=True, return_dict=False, **kwargs))


def greedy_reply(reference: LLM, prompt_ids: list[int], max_tokens: int) -> Any:
    return reference.generate([{"prompt_token_ids": prompt_ids}],
                              SamplingParams(temperature=0, max_tokens=max_tokens),
                              use_tqdm=False)[0].outputs[0]


def test_tools_and_tool_history_reach_the_chat_template(tool_server: ServerProcess,
                                                        tool_model_dir: str) -> None:
    response = httpx.post(f"{tool_server.base_url}/tokenize",
                          json={"messages": HISTORY, "tools": TOOLS}, timeout=60)
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    assert tokens == expected_prompt(tool_model_dir, HISTORY, tools=TOOLS)
    text = httpx.post(f"{tool_server.base_url}/detokenize", json={"tokens": tokens}).json()
    prompt = text["prompt"]
    assert '"name": "get_weather", "description": "The weather in a city"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<tool_response id="call_1">\n{"temp_c": 21}\n</tool_response>' in prompt


def test_a_reply_with_tools_but_no_call_is_shaped_right(tool_server: ServerProcess,
                                                        tool_model_dir: str,
                                                        reference: LLM) -> None:
    prompt_ids = expected_prompt(tool_model_dir, HISTORY, tools=TOOLS)
    want = greedy_reply(reference, prompt_ids, 8)
    assert "<tool_call>" not in want.text and "<think>" not in want.text
    c = client(tool_server)
    full = c.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS,
                                     temperature=0, max_tokens=8)
    choice = full.choices[0]
    assert choice.message.content == want.text and not choice.message.tool_calls
    assert choice.finish_reason == want.finish_reason
    assert full.usage.prompt_tokens == len(prompt_ids)  # the tools were in the prompt

    text, tool_deltas, finish = "", [], None
    for chunk in c.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS,
                                           temperature=0, max_tokens=8, stream=True):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            tool_deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert (text, tool_deltas, finish) == (want.text, [], want.finish_reason)


def test_tool_choices_the_server_cannot_honour_are_refused(
        tool_server: ServerProcess, server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": HISTORY, "tools": TOOLS, "max_tokens": 2}
    url = f"{tool_server.base_url}/v1/chat/completions"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert_error(httpx.post(url, json={**body, "tool_choice": named}), 400, "BadRequestError",
                 "tool_choice", "names the function 'get_time', which is not among the tools")
    assert_error(httpx.post(url, json={**body, "tool_choice": "required",
                                       "response_format": {"type": "json_object"}}), 400,
                 "BadRequestError", "response_format", "cannot be combined with tool_choice")
    assert_error(httpx.post(url, json={**body, "tools": None, "tool_choice": "auto"}), 400,
                 "BadRequestError", "tool_choice", "needs tools")
    # A server without --enable-auto-tool-choice: tools need tool_choice "none" (as in vLLM).
    plain = {**body, "model": "tiny"}
    assert_error(httpx.post(f"{server.base_url}/v1/chat/completions", json=plain), 400,
                 "BadRequestError", "tool_choice", "--enable-auto-tool-choice")
    ok = httpx.post(f"{server.base_url}/v1/chat/completions",
                    json={**plain, "tool_choice": "none"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"] == []


def test_reasoning_content_when_the_prompt_opens_a_think(tool_server: ServerProcess,
                                                         tool_model_dir: str,
                                                         reference: LLM) -> None:
    messages = [{"role": "user", "content": "Think first"}]
    prompt_ids = expected_prompt(tool_model_dir, messages, think_in_prompt=True)
    want = greedy_reply(reference, prompt_ids, 10)
    assert "</think>" not in want.text
    c = client(tool_server)
    kwargs: dict[str, Any] = dict(model=MODEL, messages=messages, temperature=0, max_tokens=10,
                                  extra_body={"chat_template_kwargs": {"think_in_prompt": True}})
    message = c.chat.completions.create(**kwargs).choices[0].message
    assert message.model_extra["reasoning_content"] == want.text
    assert message.content is None
    reasoning, content = "", ""
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == (want.text, "")
    # include_reasoning false: the reasoning is dropped, not moved into the content.
    dropped = c.chat.completions.create(**{**kwargs, "extra_body": {
        **kwargs["extra_body"], "include_reasoning": False}}).choices[0].message
    assert dropped.content is None and dropped.model_extra["reasoning_content"] is None


def test_enable_thinking_passes_through_to_the_template(tool_server: ServerProcess,
                                                        tool_model_dir: str,
                                                        reference: LLM) -> None:
    messages = [{"role": "user", "content": "No thinking"}]
    base = f"{tool_server.base_url}"
    tokens = httpx.post(f"{base}/tokenize", json={
        "messages": messages, "chat_template_kwargs": {"enable_thinking": False}}).json()
    prompt = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert prompt["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    prompt_ids = expected_prompt(tool_model_dir, messages, enable_thinking=False)
    assert tokens["tokens"] == prompt_ids
    want = greedy_reply(reference, prompt_ids, 6)
    message = client(tool_server).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.content == want.text and message.model_extra["reasoning_content"] is None


def stream_chunks(reply: _Reply, deltas: list[str], finish_reason: str) -> list[str]:
    """The SSE events serving_chat sends for these text deltas of one choice."""
    events = []
    for i, text in enumerate(deltas):
        last = i == len(deltas) - 1
        delta = reply.feed(text, last)
        events.append(ChatCompletionStreamResponse.model_validate({
            "id": "chatcmpl-1", "created": 0, "model": MODEL, "choices": [{
                "index": 0, "delta": delta.model_dump(),
                "finish_reason": reply.finish_reason(finish_reason if last else None)}]
        }).model_dump_json())
    return events


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_tool_calls_accumulate_in_the_openai_client(parallel: bool) -> None:
    """The streamed deltas of a reply with reasoning and two calls, as the openai client's own
    stream accumulator reads them, equal the non-streamed message."""
    text = ('<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": '
            '"get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    parsing = _Parsing(reasoning=Qwen3ReasoningParser, prompt_opens_reasoning=False,
                       include_reasoning=True, tools=HermesToolParser,
                       parallel_tool_calls=parallel)
    whole = _Reply(parsing)
    whole.feed(text, last=True)
    message = whole.message()
    assert message.content is None
    assert message.reasoning_content == "\nNeed the weather.\n"
    cities = ["Paris", "Oslo"] if parallel else ["Paris"]
    assert [json.loads(call.function.arguments)["city"] for call in message.tool_calls] == cities
    assert whole.finish_reason("stop") == "tool_calls"
    assert whole.finish_reason("length") == "length"

    state = ChatCompletionStreamState()
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    for event in stream_chunks(_Reply(parsing), pieces, "stop"):
        state.handle_chunk(ChatCompletionChunk.model_validate_json(event))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(call.function.name, json.loads(call.function.arguments)) for call in
            final.message.tool_calls] == [("get_weather", {"city": c}) for c in cities]
    assert all(call.id.startswith("call_") and call.type == "function"
               for call in final.message.tool_calls)
