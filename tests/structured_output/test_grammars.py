"""The grammars behind structured outputs, on the tiny model's byte-level BPE vocabulary:
choices spelled exactly (quotes, backslashes, newlines), the tool-call constraint in each
parser's format, the manager's bitmask rows equal to what its matchers allow, compiles cached by
key."""

from __future__ import annotations

import json
import time

import pytest
import xgrammar as xgr

from sluice.core.request import Request
from sluice.entrypoints.openai.protocol import ChatTool, NamedToolChoice
from sluice.entrypoints.openai.structured import tool_call_constraint
from sluice.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    SmolLM2ToolParser,
    ToolParser,
)
from sluice.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.structured_output.grammar import compile_grammar, grammar_key
from sluice.structured_output.manager import StructuredOutputManager, unpack_bitmask

TOOLS = [ChatTool.model_validate(t) for t in (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any object
)]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler(qwen3_dir: str) -> xgr.GrammarCompiler:
    manager = StructuredOutputManager(qwen3_dir, vocab_size=700)
    yield manager._get_compiler()
    manager.shutdown()


def matches(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams, text: str) -> bool:
    """Whether `text` is a whole reply of the grammar."""
    matcher = xgr.GrammarMatcher(compile_grammar(compiler, grammar_key(params)),
                                 terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_choices_are_spelled_exactly(compiler: xgr.GrammarCompiler) -> None:
    choices = ["plain", 'say "hi"', "back\\slash", "two\nlines", "tab\tstop"]
    params = StructuredOutputsParams(choice=choices)
    for choice in choices:
        assert matches(compiler, params, choice)
    assert not matches(compiler, params, "plai")
    assert not matches(compiler, params, 'say \\"hi\\"')


def constraint(tool_choice: object, parallel_tool_calls: bool,
               parser: type[ToolParser] | None = None) -> StructuredOutputsParams:
    params, _ = tool_call_constraint(TOOLS, tool_choice, parallel_tool_calls, parser)
    return params


NAMED_PING = NamedToolChoice.model_validate({"type": "function", "function": {"name": "ping"}})


def test_tool_call_constraint_is_hermes_blocks_of_valid_arguments(
        compiler: xgr.GrammarCompiler) -> None:
    required = constraint("required", parallel_tool_calls=True)
    assert matches(compiler, required, CALL)
    assert matches(compiler, required, CALL + "\n" + PING)  # parallel calls
    assert not matches(compiler, required, "")  # at least one
    assert not matches(compiler, required, "Sure! " + CALL)  # nothing but calls
    assert not matches(compiler, required, CALL.replace('"city"', '"town"'))
    single = constraint("required", parallel_tool_calls=False)
    assert matches(compiler, single, PING) and not matches(compiler, single, PING + "\n" + CALL)
    named = constraint(NAMED_PING, parallel_tool_calls=True)
    assert matches(compiler, named, PING) and not matches(compiler, named, CALL)
    assert not matches(compiler, named, PING + "\n" + PING)  # a named function: one call
    # What the grammar allows, the hermes parser reads as calls.
    parser = HermesToolParser()
    out = parser.feed(CALL + "\n" + PING)
    out.calls += parser.finish().calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris"}), ("ping", {})]


SMOL_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SMOL_PING = '{"name": "ping", "arguments": {}}'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_PING = '{"name": "ping", "parameters": {}}'


@pytest.mark.parametrize(("parser", "one", "two", "bad"), [
    (SmolLM2ToolParser, f"<tool_call>[{SMOL_CALL}]</tool_call>",
     f"<tool_call>[{SMOL_CALL}, {SMOL_PING}]</tool_call>", f"<tool_call>{SMOL_CALL}</tool_call>"),
    (Llama3JsonToolParser, LLAMA_CALL, f"{LLAMA_CALL}; {LLAMA_PING}", SMOL_CALL),
])
def test_tool_call_constraint_in_the_parsers_format(compiler: xgr.GrammarCompiler,
                                                    parser: type[ToolParser], one: str,
                                                    two: str, bad: str) -> None:
    required = constraint("required", True, parser)
    assert matches(compiler, required, one) and matches(compiler, required, two)
    assert not matches(compiler, required, bad) and not matches(compiler, required, "")
    single = constraint("required", False, parser)
    assert matches(compiler, single, one) and not matches(compiler, single, two)
    assert not matches(compiler, constraint(NAMED_PING, True, parser), one)
    # The parser reads what its grammar allows.
    reader = parser()
    out = reader.feed(two)
    out.calls += reader.finish().calls
    assert [c.function.name for c in out.calls] == ["get_weather", "ping"]
    assert out.content == ""


def test_parsers_without_a_format_of_their_own_are_forced_in_hermes() -> None:
    for parser in (PythonicToolParser, MistralToolParser, None):
        params, reader = tool_call_constraint(TOOLS, "required", True, parser)
        assert reader is HermesToolParser
        assert params == constraint("required", True, HermesToolParser)


def test_the_managers_bitmask_rows_are_the_matchers_allowed_tokens(qwen3_dir: str) -> None:
    manager = StructuredOutputManager(qwen3_dir, vocab_size=700)
    try:
        requests = [Request(f"r{i}", [1, 2], SamplingParams(structured_outputs=spec),
                            eos_token_ids={642})
                    for i, spec in enumerate([StructuredOutputsParams(choice=["ab", "cd"]),
                                              StructuredOutputsParams(regex="[0-9]+"),
                                              StructuredOutputsParams(choice=["ab", "cd"])])]
        for request in requests:
            manager.add_request(request)
        # Equal keys share one compile.
        assert manager.requests["r0"].compiled is manager.requests["r2"].compiled
        deadline = time.monotonic() + 30
        while not all(manager.is_ready(r.request_id) for r in requests):
            manager.wait_for_compiles(0.1)
            assert time.monotonic() < deadline
        assert manager.accept_tokens("r1", [manager_token(qwen3_dir, "7")]) == 1
        bitmask = manager.grammar_bitmask(["r1", "r0"])
        assert bitmask.req_ids == ["r1", "r0"]
        rows = unpack_bitmask(bitmask.bitmask, 2, manager.num_words)
        allowed = [{v for v in range(700) if rows[r, v // 32] >> (v % 32) & 1} for r in (0, 1)]
        # r1 after "7": more digits or the end (EOS); r0: the first token of "ab" or "cd".
        tokenizer = load(qwen3_dir)
        assert 642 in allowed[0] and all(tokenizer.decode([v]).isdigit()
                                         for v in allowed[0] - {642})
        assert allowed[1] and all("ab".startswith(tokenizer.decode([v]))
                                  or "cd".startswith(tokenizer.decode([v]))
                                  for v in allowed[1])
        assert not allowed[0] & set(range(643, 700))  # past the tokenizer: never allowed
        for request in requests:
            manager.remove(request.request_id)
        assert manager.requests == {}
    finally:
        manager.shutdown()


def load(model_dir: str):  # noqa: ANN201
    from sluice.model.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


def manager_token(model_dir: str, text: str) -> int:
    (token_id,) = load(model_dir).encode(text, add_special_tokens=False)
    return token_id
