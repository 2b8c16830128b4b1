"""The engine with an 8-bit KV cache (`kv_cache_dtype="fp8"`): the cache is float8_e4m3fn and
holds more blocks in the same budget; prefix caching, chunked prefill, preemption, async
scheduling and n-gram speculation leave its greedy output as it is with the same cache dtype;
the same for preemption and chunks with `"fp8_e5m2"`; a bad value is refused by name. (With KV
connectors: the CPU tier's, the pool's and PD's tests.)"""

from __future__ import annotations

import pytest
import torch

from sluice import LLM
from tests.engine.test_generate_matches_hf import (
    CONFIGS,
    assert_integrity_and_all_free,
    make_prompts,
    sluice_greedy,
)

BASE = dict(dtype="float32", block_size=8, max_model_len=256, max_num_batched_tokens=32,
            kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def fp8_reference(qwen3_dir: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, greedy outputs) of the fp8 engine with the default settings."""
    llm = LLM(model=qwen3_dir, **BASE)
    prompts = make_prompts(llm.llm_engine.hf_config.vocab_size, seed=1)
    prompts.append(prompts[-1][:100] + [7, 8, 9])  # a shared prefix for the cache to hit
    want, _ = sluice_greedy(llm, prompts, 64)
    assert_integrity_and_all_free(llm)
    return prompts, want


@pytest.mark.parametrize("name", ["prefix_caching_off", "forced_preemption",
                                  "small_chunks_two_partial", "async_scheduling_with_preemption",
                                  "async_ngram_by_acceptance"])
def test_optimisations_leave_fp8_greedy_output_unchanged(qwen3_dir: str, fp8_reference,
                                                         name: str) -> None:
    prompts, want = fp8_reference
    # Longer outputs with n-gram speculation (its drafts predict the tiny model's loops); the
    # preemption settings' max_model_len leaves room for 24.
    max_tokens = 64 if "ngram" in name else 24
    llm = LLM(model=qwen3_dir, **{**BASE, **CONFIGS[name]})
    got, _ = sluice_greedy(llm, prompts, max_tokens)
    assert got == [tokens[:max_tokens] for tokens in want]
    if "preemption" in name:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_integrity_and_all_free(llm)


def test_fp8_cache_holds_four_times_the_blocks_of_a_float32_one(qwen3_dir: str,
                                                               fp8_reference) -> None:
    prompts, fp8_out = fp8_reference
    sizes = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(model=qwen3_dir, **{**BASE, "kv_cache_dtype": kv_cache_dtype},
                  cpu_kv_cache_bytes=1 << 20)
        runner = llm.llm_engine.engine_core.executor.model_runner
        caches = list(runner.kv_caches.values())
        assert {c.dtype for c in caches} == {
            torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32}
        sizes[kv_cache_dtype] = runner.num_blocks
        if kv_cache_dtype == "auto":
            float32_out, _ = sluice_greedy(llm, prompts, 64)
    assert sizes["fp8"] == 4 * sizes["auto"]
    # Quantization, not an optimisation: the tokens part ways, sooner for a random model's flat
    # logits than for a trained one's (here after 0, 0, 4, 1, 1, 45 and 64 of 64 tokens). A
    # cache read wrongly would agree on the first token about once in the vocabulary's 600.
    agree = [a[0] == b[0] for a, b in zip(fp8_out, float32_out)]
    assert sum(agree) > len(prompts) // 2


@pytest.mark.parametrize("name", ["forced_preemption", "small_chunks_two_partial"])
def test_an_e5m2_cache_keeps_its_greedy_output_under_preemption_and_chunks(
        qwen3_dir: str, fp8_reference, name: str) -> None:
    """`kv_cache_dtype="fp8_e5m2"`: a float8_e5m2 cache, whose output the optimisations leave
    as it is, and which is not the e4m3 cache's."""
    prompts, e4m3_out = fp8_reference
    e5m2 = {**BASE, "kv_cache_dtype": "fp8_e5m2"}
    llm = LLM(model=qwen3_dir, **e5m2)
    runner = llm.llm_engine.engine_core.executor.model_runner
    assert {c.dtype for c in runner.kv_caches.values()} == {torch.float8_e5m2}
    want, _ = sluice_greedy(llm, prompts, 24)
    assert_integrity_and_all_free(llm)
    assert want != [tokens[:24] for tokens in e4m3_out]
    llm = LLM(model=qwen3_dir, **{**e5m2, **CONFIGS[name]})
    got, _ = sluice_greedy(llm, prompts, 24)
    assert got == want
    if "preemption" in name:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_integrity_and_all_free(llm)


def test_a_bad_kv_cache_dtype_is_refused_by_name(qwen3_dir: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'int8'"):
        LLM(model=qwen3_dir, kv_cache_dtype="int8")
