"""Structured outputs in the engine, through the offline API: StructuredOutputsParams of each
kind, `n > 1`, async scheduling, the multiprocess executor (the masks travel in the step
message), speculative decoding, grammars compiling while other requests run, a grammar that
fails to compile, and the unconstrained requests of a mixed batch left as they were."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from sluice import LLM, SamplingParams, StructuredOutputsParams
from sluice.engine.processors import RequestOutputKind

pytestmark = pytest.mark.serial

ENGINE = dict(dtype="float32", max_model_len=512, block_size=8, seed=0, device="cpu")
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                   "ok": {"type": "boolean"}},
    "required": ["id", "tag", "ok"], "additionalProperties": False,
}
PROMPTS = ["The first story", "A second one", "Yet another prompt", "And the last"]


def constrained(seed: int, max_tokens: int = 300, **kinds: Any) -> SamplingParams:
    if not kinds.keys() - {"disable_any_whitespace"}:
        kinds["json"] = SCHEMA
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kinds))


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir: str) -> Iterator[LLM]:
    engine = LLM(model=qwen3_dir, **ENGINE)
    yield engine
    engine.shutdown()


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


def test_each_kind_of_structured_output(llm: LLM) -> None:
    outputs = run(llm, PROMPTS, [
        constrained(0),
        constrained(1, regex=r"[A-Z][a-z]{2,5} \d{2}"),
        constrained(2, choice=["left", "right", "straight on"]),
        constrained(3, grammar='root ::= "[" item ("," item)* "]"\nitem ::= [a-c]{1,3}'),
    ])
    texts = [o[0].text for o in outputs]
    assert all(o[0].finish_reason == "stop" for o in outputs), texts
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(r"[A-Z][a-z]{2,5} \d{2}", texts[1])
    assert texts[2] in ("left", "right", "straight on")
    assert re.fullmatch(r"\[[a-c]{1,3}(,[a-c]{1,3})*\]", texts[3])


def test_n_samples_each_follow_the_schema_with_their_own_matcher(llm: LLM) -> None:
    params = constrained(5)
    params.n = 4
    samples = llm.generate(["Four of them"], params, use_tqdm=False)[0].outputs
    assert len(samples) == 4
    for sample in samples:
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    assert len({s.text for s in samples}) == 4


def test_unconstrained_outputs_are_unchanged_in_a_mixed_batch(llm: LLM) -> None:
    alone = run(llm, PROMPTS, [GREEDY] * 4)
    mixed = run(llm, PROMPTS + PROMPTS, [GREEDY] * 4 + [constrained(i) for i in range(4)])
    assert [o[0].token_ids for o in mixed[:4]] == [o[0].token_ids for o in alone]
    for o in mixed[4:]:
        jsonschema.validate(json.loads(o[0].text), SCHEMA)


NGRAM_ALWAYS_DRAFTING = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3, "disable_by_batch_size": None,
                         "min_accepted_tokens_per_step": 0}
# Two greedy requests beside four constrained ones (compact JSON: short replies).
MIXED = [GREEDY] * 2 + [constrained(i, disable_any_whitespace=True) for i in range(4)]


@pytest.fixture(scope="module")
def mixed_reference(llm: LLM) -> list[Any]:
    return run(llm, PROMPTS[:2] + PROMPTS, MIXED)


@pytest.mark.parametrize("engine_kwargs", [
    {"async_scheduling": True},
    {"distributed_executor_backend": "mp", "async_scheduling": True},
    {"speculative_config": NGRAM_ALWAYS_DRAFTING},
    # Drafting off while 3 requests or more run, on as they end; async: a constrained request
    # and drafts both take the step in flight first.
    {"speculative_config": {**NGRAM_ALWAYS_DRAFTING, "disable_by_batch_size": 3},
     "async_scheduling": True},
], ids=["async", "mp-async", "ngram", "ngram-async"])
def test_constrained_tokens_are_the_same_with_async_mp_and_speculation(
        mixed_reference: list[Any], qwen3_dir: str, engine_kwargs: dict[str, Any]) -> None:
    """Seeded samples draw from their own generators: the same tokens whatever the engine,
    as long as every mask was built after the previous token reached the matcher (with async
    scheduling, a stale mask would let the matcher refuse a token and fail the request), and
    reached the sampler (mp: in the step message). Greedy rows beside them stay as they were."""
    other = LLM(model=qwen3_dir, **ENGINE, **engine_kwargs)
    try:
        got = run(other, PROMPTS[:2] + PROMPTS, MIXED)
    finally:
        other.shutdown()
    assert [o[0].finish_reason for o in got[2:]] == ["stop"] * 4
    assert [o[0].token_ids for o in got] == [o[0].token_ids for o in mixed_reference]


def test_a_request_compiling_its_grammar_does_not_hold_up_others(llm: LLM) -> None:
    manager = llm.llm_engine.engine_core.structured_output
    release = threading.Event()
    compile_grammar = manager._compile

    def slow_compile(key: Any) -> Any:
        release.wait(30)
        return compile_grammar(key)

    manager._compile = slow_compile
    engine = llm.llm_engine
    try:
        # A grammar no other test compiled (the cache would answer at once).
        engine.add_request("slow", "Wait for me", constrained(0, regex=r"slow[0-9]{2}"),
                           RequestOutputKind.FINAL_ONLY)
        engine.add_request("quick", "Go ahead", GREEDY, RequestOutputKind.FINAL_ONLY)
        finished: dict[str, Any] = {}
        while "quick" not in finished:
            for output in engine.step():
                finished[output.request_id] = output
        assert "slow" not in finished  # passed over while compiling, not blocking "quick"
        release.set()
        while engine.has_unfinished_requests():
            for output in engine.step():
                finished[output.request_id] = output
    finally:
        manager._compile = compile_grammar
        release.set()
    assert re.fullmatch(r"slow[0-9]{2}", finished["slow"].outputs[0].text)
    assert len(finished["quick"].outputs[0].token_ids) == 20


def test_a_grammar_that_fails_to_compile_fails_only_its_request(llm: LLM) -> None:
    manager = llm.llm_engine.engine_core.structured_output
    compile_grammar = manager._compile

    def failing_compile(key: Any) -> Any:
        raise RuntimeError("compiler exploded")

    manager._compile = failing_compile
    try:
        outputs = llm.generate(["Bad", "Good"], [constrained(0, regex=r"never[0-9]"), GREEDY],
                               use_tqdm=False)
    finally:
        manager._compile = compile_grammar
        manager._cache.clear()  # the failed compile is cached under that key
    bad, good = outputs[0].outputs[0], outputs[1].outputs[0]
    assert (bad.finish_reason, bad.token_ids) == ("error", [])
    assert "compiler exploded" in bad.stop_reason
    assert len(good.token_ids) == 20
    assert manager.requests == {}  # nothing left behind


def test_finish_reasons_with_a_grammar(llm: LLM) -> None:
    # ignore_eos: no stop token, the grammar's end ends the reply ("stop").
    choice = constrained(0, choice=["alpha", "beta"])
    choice.ignore_eos = True
    # A grammar that cannot end within max_tokens: "length", the text a prefix of a match.
    short = constrained(1, max_tokens=4, regex=r"[a-z]{30}")
    outputs = run(llm, ["One", "Two"], [choice, short])
    assert (outputs[0][0].finish_reason, outputs[0][0].text in ("alpha", "beta")) == ("stop",
                                                                                      True)
    assert outputs[1][0].finish_reason == "length"
    assert re.fullmatch(r"[a-z]+", outputs[1][0].text) and len(outputs[1][0].token_ids) == 4


def test_bad_constraints_are_value_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate(["x"], constrained(0, regex="(a"), use_tqdm=False)
    with pytest.raises(ValueError, match="invalid JSON schema"):
        llm.generate(["x"], constrained(0, json={"type": "object", "properties": 3}),
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, "):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match=r"logit_bias must be values in \[-100, 100\]"):
        SamplingParams(logit_bias={3: -100.5})
    assert llm.llm_engine.engine_core.structured_output.requests == {}
