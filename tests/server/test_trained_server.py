"""`sluice serve` with no model: the built-in SmolLM2-135M-Instruct (the .gguf the package ships,
put where the first fetch would have put it), through the real openai client. Greedy replies
and prompt logprobs equal transformers'; tool_choice required, named and auto end as OpenAI's
do, streamed as not streamed, with no tool-call markup in the content; json_schema replies
parse."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from sluice.model.builtin import SMOLLM2_CHAT_TEMPLATE, SMOLLM2_NAME, smollm2_path
from sluice.model.hub import sluice_cache_dir
from tests.conftest import HFReference, TrainedModel
from tests.engine.test_trained_model import CONVERSATIONS, EOS_ID, MAX_TOKENS
from tests.server.conftest import ServerProcess, launch_server

pytestmark = pytest.mark.serial  # a server process


def tool(name: str, description: str, argument: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string"}},
                       "required": [argument]}}}

WEATHER = tool("get_weather", "Get the current weather in a city", "city")
TIME = tool("get_time", "Get the current local time in a timezone", "timezone")
SEARCH = tool("search_web", "Search the web for a query", "query")


@pytest.fixture(scope="module")
def builtin_server(smollm2: TrainedModel, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    # The cache as a first fetch leaves it (the file, from the installed package); kept between
    # runs, so the folder made of the .gguf is made once.
    cache = os.path.join(sluice_cache_dir(), "tests", "builtin")
    target = smollm2_path(cache)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if not os.path.isfile(target):
        if os.path.islink(target):  # left by a run whose environment is gone
            os.unlink(target)
        os.symlink(smollm2.gguf, target)
    started = launch_server(None, tmp_path_factory.mktemp("builtin") / "server.log",
                            "--enable-auto-tool-choice", "--num-gpu-blocks-override", "256",
                            env={"SLUICE_CACHE_DIR": cache})
    yield started
    assert started.stop() == 0, started.log()[-4000:]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_the_built_in_model_answers_as_transformers(builtin_server: ServerProcess,
                                                    smollm2_reference: HFReference) -> None:
    c = client(builtin_server)
    assert [m.id for m in c.models.list().data] == [SMOLLM2_NAME]
    for messages in CONVERSATIONS:
        want = smollm2_reference.greedy(smollm2_reference.chat_ids(messages), MAX_TOKENS)
        reply = c.chat.completions.create(model=SMOLLM2_NAME, messages=messages,
                                          temperature=0, max_tokens=MAX_TOKENS)
        choice = reply.choices[0]
        assert choice.message.content == smollm2_reference.tokenizer.decode(
            want, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if want[-1] == EOS_ID else "length")
        assert reply.usage.completion_tokens == len(want)


def test_echo_and_prompt_logprobs_equal_transformers(builtin_server: ServerProcess,
                                                     smollm2_reference: HFReference) -> None:
    text = "Water boils at one hundred degrees Celsius at sea level."
    token_ids = smollm2_reference.tokenizer.encode(text)
    want = smollm2_reference.prompt_logprobs(token_ids)
    c = client(builtin_server)
    echoed = c.completions.create(model=SMOLLM2_NAME, prompt=text, echo=True, logprobs=0,
                                  max_tokens=1, temperature=0).choices[0].logprobs
    assert echoed.token_logprobs[0] is None
    got = echoed.token_logprobs[1:len(token_ids)]
    assert max(abs(g - w) for g, w in zip(got, want)) < 2e-3
    vllm_style = c.completions.create(model=SMOLLM2_NAME, prompt=text, max_tokens=1,
                                      extra_body={"prompt_logprobs": 0})
    positions = vllm_style.choices[0].model_extra["prompt_logprobs"]
    assert positions[0] is None
    got = [position[str(token)]["logprob"] for position, token in zip(positions[1:],
                                                                     token_ids[1:])]
    assert max(abs(g - w) for g, w in zip(got, want)) < 2e-3


def calls(message: Any) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments))
            for call in message.tool_calls or []]


def streamed(c: openai.OpenAI, **kwargs: Any) -> tuple[str | None, list[tuple[str, dict]], str]:
    """A streamed reply as the client sees it: its content, calls and finish_reason."""
    content, pieces, finish = None, {}, None
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                name, args = pieces.get(call.index, ("", ""))
                pieces[call.index] = (name + (call.function.name or ""),
                                      args + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content, [(n, json.loads(a)) for _, (n, a) in sorted(pieces.items())], finish


@pytest.mark.parametrize(("tools", "tool_choice", "question", "call", "finish"), [
    ([WEATHER], "required", "What's the weather like in Paris?",
     ("get_weather", {"city": "Paris"}), "tool_calls"),
    ([WEATHER, TIME, SEARCH], "required", "What time is it in Tokyo?",
     ("get_time", {"timezone": "UTC"}), "tool_calls"),
    ([WEATHER, TIME, SEARCH], {"type": "function", "function": {"name": "get_weather"}},
     "Is it raining in London?", ("get_weather", {"city": "London"}), "stop"),
])
def test_forced_tool_calls_end_with_a_complete_call(builtin_server: ServerProcess, tools: list,
                                                    tool_choice: Any, question: str,
                                                    call: tuple, finish: str) -> None:
    c = client(builtin_server)
    kwargs = dict(model=SMOLLM2_NAME, messages=[{"role": "user", "content": question}],
                  tools=tools, tool_choice=tool_choice, temperature=0, max_tokens=96)
    choice = c.chat.completions.create(**kwargs).choices[0]
    assert (choice.message.content, calls(choice.message), choice.finish_reason) == (
        None, [call], finish)
    assert streamed(c, **kwargs) == (None, [call], finish)


def test_a_forced_call_cut_off_by_max_tokens_shows_no_markup(
        builtin_server: ServerProcess) -> None:
    c = client(builtin_server)
    kwargs = dict(model=SMOLLM2_NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                  tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=12)
    choice = c.chat.completions.create(**kwargs).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        None, [], "length")
    assert streamed(c, **kwargs) == (None, [], "length")


def test_auto_tool_choice_keeps_a_text_reply(builtin_server: ServerProcess,
                                             smollm2_reference: HFReference) -> None:
    """SmolLM2-135M answers this in text (it never chose a call on its own in our trials):
    the reply is its greedy text on the prompt with the tools, and no calls."""
    messages = [{"role": "user", "content": "Tell me a joke."}]
    tools = [WEATHER, TIME, SEARCH]
    prompt = smollm2_reference.chat_ids(messages, tools=tools,
                                        chat_template=SMOLLM2_CHAT_TEMPLATE)
    want = smollm2_reference.greedy(prompt, 32)
    c = client(builtin_server)
    kwargs = dict(model=SMOLLM2_NAME, messages=messages, tools=tools, temperature=0,
                  max_tokens=32)
    reply = c.chat.completions.create(**kwargs)
    text = smollm2_reference.tokenizer.decode(want, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(prompt)
    assert (reply.choices[0].message.content, reply.choices[0].message.tool_calls) == (text, [])
    assert streamed(c, **kwargs)[:2] == (text, [])


def test_json_schema_replies_parse(builtin_server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    reply = client(builtin_server).chat.completions.create(
        model=SMOLLM2_NAME, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Name the capital of France and its country."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place",
                                                                "schema": schema}})
    value = json.loads(reply.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert value["city"] == "Paris"
