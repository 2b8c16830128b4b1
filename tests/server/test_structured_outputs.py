"""Structured outputs, constrained tool calls and logit_bias through `sluice serve`, with the
real openai client on loopback. The tiny model's weights are random: whatever it would say,
the grammar masks make its replies parse and match the schema, regex or choices."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from sluice import LLM, SamplingParams
from tests.server.conftest import ServerProcess
from tests.server.test_server_errors import assert_error

pytestmark = pytest.mark.serial

MODEL = "tiny"
# Bounded strings by pattern (xgrammar's maxLength strings admit raw control characters, which
# strict JSON parsers refuse; see the README), so a random model's reply ends well within
# max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                 "maxItems": 3},
    },
    "required": ["name", "age", "member", "color", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
            "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -99, "maximum": 99},
            "b": {"type": "integer", "minimum": -99, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "Tell me about someone."}]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def check_tool_calls(calls: list[Any], names: set[str]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_json_schema_replies_parse_and_validate_for_50_requests(server: ServerProcess) -> None:
    c = client(server)
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def ask(seed: int) -> Any:
        return c.chat.completions.create(model=MODEL, messages=MESSAGES, seed=seed,
                                         max_tokens=600, response_format=response_format)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(ask, range(50)))
    replies = set()
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])  # the schema's order
        replies.add(choice.message.content)
    assert len(replies) > 40  # sampled, seeded apart: not one reply 50 times


def test_n_samples_each_parse_and_json_object_meets_logit_bias(server: ServerProcess,
                                                             reference: LLM) -> None:
    c = client(server)
    response = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, seed=7, max_tokens=600,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    contents = [choice.message.content for choice in response.choices]
    for content in contents:
        jsonschema.validate(json.loads(content), SCHEMA)
    assert len(set(contents)) == 3  # one matcher per sample
    # json_object (compact, vLLM's disable_any_whitespace): a random model's keys never end,
    # so a bias on "}" closes the object at once; the mask still rules out "}" first.
    close = reference.get_tokenizer().convert_tokens_to_ids("}")
    text = c.completions.create(
        model=MODEL, prompt="JSON:", seed=3, max_tokens=50, logit_bias={str(close): 100},
        extra_body={"structured_outputs": {"json_object": True,
                                           "disable_any_whitespace": True}}).choices[0].text
    assert text == "{}"


def test_guided_choice_answers_are_always_one_of_the_choices(server: ServerProcess) -> None:
    c = client(server)
    choices = ["yes", "no", "maybe not", 'a "quoted"\nline']
    seen = set()
    for seed in range(12):
        text = c.completions.create(model=MODEL, prompt="Answer:", seed=seed, max_tokens=20,
                                    extra_body={"guided_choice": choices}).choices[0].text
        assert text in choices
        seen.add(text)
    assert len(seen) > 1
    chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                     max_tokens=20, extra_body={"structured_outputs": {
                                         "choice": choices}})
    assert chat.choices[0].message.content in choices


def test_regex_and_grammar_replies_match(server: ServerProcess) -> None:
    c = client(server)
    pattern = r"[A-Z]{2}-\d{3}( [a-z]{1,4})?"
    for seed in range(6):
        text = c.completions.create(model=MODEL, prompt="Code:", seed=seed, max_tokens=30,
                                    extra_body={"guided_regex": pattern}).choices[0].text
        assert re.fullmatch(pattern, text), text
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    stream = c.completions.create(model=MODEL, prompt="Sum:", seed=1, max_tokens=60,
                                  stream=True, extra_body={"guided_grammar": grammar})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert re.fullmatch(r"\((?:[1-9][0-9]?)(?: \+ [1-9][0-9]?)*\)", text), text


def test_a_grammar_that_cannot_end_within_max_tokens_finishes_with_length(
        server: ServerProcess) -> None:
    c = client(server)
    choice = c.completions.create(model=MODEL, prompt="Code:", seed=0, max_tokens=3,
                                  extra_body={"guided_regex": r"[a-z]{40}"}).choices[0]
    assert choice.finish_reason == "length"
    assert re.fullmatch(r"[a-z]+", choice.text) and len(choice.text) < 40


def test_tool_choice_required_yields_parseable_tool_calls(server: ServerProcess,
                                                         reference: LLM) -> None:
    c = client(server)
    # After each call the grammar allows another or the end: a random model would go on
    # calling until max_tokens, so the end is favoured (the mask still decides where it may
    # come). Several calls in one reply: test_tool_call_constraint_* in tests/structured_output.
    end = {str(reference.get_tokenizer().convert_tokens_to_ids("<|im_end|>")): 100}
    for seed in range(3):
        response = c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                             tool_choice="required", seed=seed, max_tokens=600,
                                             logit_bias=end)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        check_tool_calls(choice.message.tool_calls, {"get_weather", "add"})
        assert len(choice.message.tool_calls) == 1
    # Without the bias, parallel calls off: the grammar itself ends after one call.
    response = c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         seed=5, max_tokens=600)
    assert response.choices[0].finish_reason == "tool_calls"
    check_tool_calls(response.choices[0].message.tool_calls, {"get_weather", "add"})
    assert len(response.choices[0].message.tool_calls) == 1


def test_tool_choice_required_and_named_streamed(server: ServerProcess) -> None:
    c = client(server)
    named = {"type": "function", "function": {"name": "add"}}
    for tool_choice, names, finish in (("required", {"get_weather", "add"}, "tool_calls"),
                                       (named, {"add"}, "stop")):
        state = ChatCompletionStreamState()
        stream = c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                           tool_choice=tool_choice, seed=11, max_tokens=600,
                                           parallel_tool_calls=False, stream=True)
        for chunk in stream:
            state.handle_chunk(chunk)
        message = state.get_final_completion().choices[0]
        assert message.finish_reason == finish
        assert not message.message.content
        check_tool_calls(message.message.tool_calls, names)
        if tool_choice is named:
            assert len(message.message.tool_calls) == 1
    # The same named call, not streamed.
    response = c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                         tool_choice=named, seed=11, max_tokens=600)
    assert response.choices[0].finish_reason == "stop"
    check_tool_calls(response.choices[0].message.tool_calls, {"add"})


def test_logit_bias_steers_sampling_but_not_logprobs(server: ServerProcess,
                                                     reference: LLM) -> None:
    c = client(server)
    tokenizer = reference.get_tokenizer()
    prompt = tokenizer.encode("The weather today")
    greedy = reference.generate([{"prompt_token_ids": prompt}],
                                SamplingParams(temperature=0, max_tokens=1),
                                use_tqdm=False)[0].outputs[0].token_ids[0]

    def first_token(**kwargs: Any) -> Any:
        return c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1,
                                    logprobs=0, **kwargs).choices[0]

    assert first_token().logprobs.tokens[0] == tokenizer.decode([greedy])
    banned = first_token(logit_bias={str(greedy): -100})
    assert banned.logprobs.tokens[0] != tokenizer.decode([greedy])
    forced_id = next(t for t in range(300, 400) if t != greedy)
    forced = c.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=0,
                                  max_tokens=4, logprobs=0, extra_body={"ignore_eos": True},
                                  logit_bias={str(forced_id): 100})
    text = tokenizer.decode([forced_id])
    assert forced.choices[0].logprobs.tokens == [text] * 4
    # The logprob is the model's own (the bias is not in it): the reference's prompt logprob
    # of the same token after the same prompt.
    want = reference.generate([{"prompt_token_ids": prompt + [forced_id]}],
                              SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0].prompt_logprobs[-1][forced_id].logprob
    assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(want, abs=1e-4)
    assert want < -1.0


def test_unconstrained_replies_are_unchanged_beside_constrained_ones(
        server: ServerProcess, reference: LLM) -> None:
    c = client(server)
    prompts = [f"Story {i}: once upon a time" for i in range(6)]
    want = [o.outputs[0].text for o in reference.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        use_tqdm=False)]

    def plain(i: int) -> str:
        return c.completions.create(model=MODEL, prompt=prompts[i], temperature=0,
                                    max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text

    def constrained(i: int) -> str:
        return c.completions.create(
            model=MODEL, prompt=prompts[i], seed=i, max_tokens=600,
            extra_body={"guided_json": SCHEMA}).choices[0].text

    with ThreadPoolExecutor(12) as pool:
        constrained_futures = [pool.submit(constrained, i) for i in range(6)]
        plain_futures = [pool.submit(plain, i) for i in range(6)]
        got = [f.result() for f in plain_futures]
        for future in constrained_futures:
            jsonschema.validate(json.loads(future.result()), SCHEMA)
    assert got == want


@pytest.mark.parametrize(("body", "param", "match"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format",
     'invalid JSON schema: Unsupported type "nope"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema must be a JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "(a"}, "guided_regex", "invalid regex: Regex parsing error"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", 'Rule "missing" is not defined'),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {"json": {"type": "object"}, "colour": 1}}, "structured_outputs",
     "unknown field `colour`"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice",
     "cannot be combined with guided_regex"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "0 with structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "wrong"}}}}}],
      "tool_choice": "required"}, "tools", "invalid structural tag"),
])
def test_bad_constraints_are_400s_naming_the_field(server: ServerProcess, body: dict[str, Any],
                                                   param: str, match: str) -> None:
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4} | body
    assert_error(httpx.post(f"{server.base_url}/v1/chat/completions", json=request,
                            timeout=60), 400, "BadRequestError", param, match)
