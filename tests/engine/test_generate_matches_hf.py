"""Greedy output of sluice equals transformers' greedy `generate`, and no optimisation (prefix
caching, chunked prefill, preemption, async scheduling, n-gram speculation with the drafting
policy switching steps between overlapped and synchronous) changes it."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from sluice import LLM, SamplingParams
from tests.tiny_models import ARCHS

MAX_TOKENS = 24
# Prompt lengths: several longer than the 32-token prefill chunk used below.
PROMPT_LENS = (5, 17, 40, 77, 33, 120)


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


@functools.cache
def hf_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    import transformers

    model = _hf_model(model_dir)
    input_ids = torch.tensor([prompt])
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
        # an id past the vocabulary: no stop (None would take the model's own EOS, and
        # sluice runs with ignore_eos)
        eos_token_id=1 << 30, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=config)
    return out[0, len(prompt):].tolist()


@functools.cache
def _hf_model(model_dir: str):  # noqa: ANN202
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()


def sluice_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):  # noqa: ANN201
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], outputs


def assert_integrity_and_all_free(llm: LLM) -> None:
    manager = llm.llm_engine.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1
    assert not llm.llm_engine.scheduler.has_unfinished_requests()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_token_ids_equal_transformers(hf_model_dirs: dict[str, str], arch: str) -> None:
    model_dir = hf_model_dirs[arch]
    llm = LLM(model=model_dir, dtype="float32", block_size=8, max_num_batched_tokens=32,
              max_model_len=256)
    vocab = llm.llm_engine.hf_config.vocab_size
    prompts = make_prompts(vocab)
    got, _ = sluice_greedy(llm, prompts)
    want = [hf_greedy(model_dir, tuple(p), MAX_TOKENS) for p in prompts]
    assert got == want
    assert_integrity_and_all_free(llm)


NGRAM_SWITCHING = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3, "disable_by_batch_size": None,
                   "min_accepted_tokens_per_step": 1.0, "probe_interval": 1}
CONFIGS = {
    "prefix_caching_off": dict(enable_prefix_caching=False),
    "chunked_prefill_off": dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
    # 19 usable blocks of 8 tokens cannot hold all seven requests at once: forces preemption.
    "forced_preemption": dict(num_gpu_blocks_override=20, max_num_batched_tokens=64,
                              max_model_len=152),
    "small_chunks_two_partial": dict(max_num_batched_tokens=16, max_num_partial_prefills=2),
    "long_prefill_threshold": dict(long_prefill_token_threshold=16, max_num_partial_prefills=3),
    # The next step is scheduled before the last one's tokens are back (the GPU default).
    "async_scheduling": dict(async_scheduling=True),
    "async_scheduling_with_preemption": dict(async_scheduling=True, num_gpu_blocks_override=20,
                                             max_num_batched_tokens=64, max_model_len=152),
    # N-gram speculation under async scheduling: drafting on while drafts would be accepted
    # (steps with drafts synchronous), off (overlapped) while not; then off while 3 or more
    # requests run, on as they end.
    "async_ngram_by_acceptance": dict(async_scheduling=True, speculative_config=NGRAM_SWITCHING),
    "async_ngram_by_acceptance_with_preemption": dict(
        async_scheduling=True, speculative_config=NGRAM_SWITCHING, num_gpu_blocks_override=26,
        max_num_batched_tokens=64, max_model_len=192),
    "async_ngram_by_acceptance_prefix_caching_off": dict(
        async_scheduling=True, speculative_config=NGRAM_SWITCHING, enable_prefix_caching=False),
    "async_ngram_by_batch_size": dict(
        async_scheduling=True, speculative_config={**NGRAM_SWITCHING, "disable_by_batch_size": 3,
                                                   "min_accepted_tokens_per_step": 0}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_optimisations_leave_greedy_output_unchanged(qwen3_dir: str, name: str) -> None:
    base = dict(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256,
                max_num_batched_tokens=32)
    reference_llm = LLM(**base)
    prompts = make_prompts(reference_llm.llm_engine.hf_config.vocab_size, seed=1)
    # Two requests share a long prefix so that prefix caching has something to hit.
    prompts.append(prompts[-1][:100] + [7, 8, 9])
    # Longer outputs with n-gram speculation: the tiny model's loops, which drafts predict.
    max_tokens = 64 if "ngram" in name else MAX_TOKENS
    want, _ = sluice_greedy(reference_llm, prompts, max_tokens)

    llm = LLM(**{**base, **CONFIGS[name]})
    got, _ = sluice_greedy(llm, prompts, max_tokens)
    assert got == want
    if "preemption" in name:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    if "ngram" in name:
        stats = llm.get_spec_decoding_stats()
        assert stats.num_accepted_tokens > 0 and stats.num_steps_drafting > 0
        assert stats.num_steps_off_acceptance + stats.num_steps_off_batch_size > 0
    assert_integrity_and_all_free(llm)


def test_shared_prefix_is_cached_and_computes_fewer_tokens(qwen3_dir: str) -> None:
    llm = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256)
    vocab = llm.llm_engine.hf_config.vocab_size
    rng = random.Random(3)
    prefix = [rng.randrange(3, vocab) for _ in range(64)]
    first = prefix + [11, 12, 13]
    second = prefix + [21, 22]

    computed: list[int] = []
    runner = llm.llm_engine.engine_core.executor.model_runner
    launch = runner.launch

    def counting_launch(scheduler_output):  # noqa: ANN001, ANN202
        computed.append(scheduler_output.total_num_scheduled_tokens)
        return launch(scheduler_output)

    runner.launch = counting_launch
    want_second, _ = sluice_greedy(LLM(model=qwen3_dir, dtype="float32", block_size=8,
                                       max_model_len=256, enable_prefix_caching=False),
                                   [second], max_tokens=4)
    _, out1 = sluice_greedy(llm, [first], max_tokens=4)
    computed_first = sum(computed)
    computed.clear()
    got_second, out2 = sluice_greedy(llm, [second], max_tokens=4)
    computed_second = sum(computed)

    assert out1[0].num_cached_tokens == 0
    assert out2[0].num_cached_tokens == 64  # eight full blocks of the shared prefix
    assert computed_first == len(first) + 3  # the prompt, then 3 decode steps
    assert computed_second == len(second) - 64 + 3
    assert got_second == want_second
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits == 64


def test_prompts_of_one_step_share_their_prefix_with_deferred_caching(qwen3_dir: str) -> None:
    """The engine enters a step's blocks into the prefix cache after the step is launched
    (KVCacheManager.defer_caching), but a prompt admitted after another in the same step still
    hits the blocks scheduled for it, and the output is what it is without the cache."""
    llm = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256)
    manager = llm.llm_engine.kv_cache_manager
    assert manager.defer_caching
    vocab = llm.llm_engine.hf_config.vocab_size
    rng = random.Random(4)
    prefix = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [prefix + [11, 12, 13], prefix + [21, 22]]
    want, _ = sluice_greedy(LLM(model=qwen3_dir, dtype="float32", block_size=8,
                                max_model_len=256, enable_prefix_caching=False), prompts)
    got, outputs = sluice_greedy(llm, prompts)
    assert got == want
    assert [o.num_cached_tokens for o in outputs] == [0, 40]
    assert_integrity_and_all_free(llm)
    # And a later prompt finds the block the first's decode filled (its 3 tokens, 5 generated).
    _, outputs = sluice_greedy(llm, [prompts[0] + got[0][:5] + [19]])
    assert outputs[0].num_cached_tokens == 48


def test_fully_cached_prompt_still_computes_its_last_token(qwen3_dir: str) -> None:
    llm = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256)
    prompt = list(range(10, 42))  # exactly four blocks
    first, _ = sluice_greedy(llm, [prompt], max_tokens=3)
    again, outputs = sluice_greedy(llm, [prompt], max_tokens=3)
    assert again == first
    assert outputs[0].num_cached_tokens == 24  # three blocks; the last block holds the last token
    assert_integrity_and_all_free(llm)


def test_reset_prefix_cache_forgets_the_prompts(qwen3_dir: str) -> None:
    llm = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256)
    prompt = list(range(10, 42))
    first, _ = sluice_greedy(llm, [prompt], max_tokens=3)
    assert llm.reset_prefix_cache()
    again, outputs = sluice_greedy(llm, [prompt], max_tokens=3)
    assert again == first
    assert outputs[0].num_cached_tokens == 0  # a cold run, as the first was
    assert_integrity_and_all_free(llm)
