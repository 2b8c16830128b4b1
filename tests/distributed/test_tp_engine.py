"""Tensor parallelism end to end on the CPU (gloo): greedy ids at TP = 2 and 4 equal TP = 1 for
Qwen3, Llama, Qwen2, Mistral, Phi-3 (its fused q/k/v and gate/up split per rank), Qwen3-MoE
(every expert's intermediate slice per rank; with expert parallelism, half the experts whole
per rank, against transformers too), Gemma 3 and a model with one KV head (replicated
on every rank), with prefix caching, chunked prefill and preemption on, sync and async
scheduling; seeded sampling and logprobs; speculative decoding; every block back afterwards; a
rank killed mid-run ends the engine within 5 s naming it, and leaves no worker behind; sizes
the model cannot split are ValueErrors naming both numbers. (Behind the server:
tests/server/test_server_errors.py.)"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.core.outputs import ModelRunnerOutput
from sluice.engine.arg_utils import EngineArgs
from sluice.errors import EngineDeadError
from sluice.executor.multiproc import MultiprocExecutor
from sluice.spec_decode.eagle_model import make_tiny_eagle
from tests.engine.test_executor import alive, worker_pids

pytestmark = pytest.mark.one_worker

# 32-token prefill chunks; 19 usable blocks of 8 tokens cannot hold every request at once.
BASE = dict(dtype="float32", block_size=8, max_model_len=152, max_num_batched_tokens=32, seed=0)
PREEMPTING = dict(num_gpu_blocks_override=20)
MAX_TOKENS = 16
PROMPT_LENS = (5, 17, 40, 77, 33, 120)


def make_prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 643) for _ in range(n)] for n in PROMPT_LENS]
    return prompts + [prompts[-1][:100] + [7, 8, 9]]  # shares 12 blocks with the one before


PROMPTS = make_prompts()


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS,
           max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_back(llm: LLM) -> None:
    manager = llm.llm_engine.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1
    assert not llm.llm_engine.scheduler.has_unfinished_requests()




_REFERENCES: dict[str, list[list[int]]] = {}


def reference(model_dir: str) -> list[list[int]]:
    """TP = 1 in the engine's process, nothing preempted."""
    if model_dir not in _REFERENCES:
        _REFERENCES[model_dir] = greedy(LLM(model=model_dir, **BASE))
    return _REFERENCES[model_dir]


@pytest.fixture(scope="module")
def qwen3_tp2(qwen3_dir: str) -> Iterator[LLM]:
    """Shared by the tests of sampling at TP = 2."""
    llm = LLM(model=qwen3_dir, tensor_parallel_size=2, **BASE)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(("model", "tp_size"), [
    ("qwen3", 2), ("qwen3", 4), ("llama", 2), ("llama", 4), ("qwen2", 4),
    ("qwen2_mqa", 2), ("qwen2_mqa", 4), ("mistral", 2), ("phi3", 2),
    ("qwen3_moe", 2), ("qwen2_moe", 2), ("mixtral", 2), ("gemma3", 2)])
def test_greedy_ids_equal_tp1_with_prefix_caching_chunks_and_preemption(
        tp_model_dirs: dict[str, str], model: str, tp_size: int) -> None:
    model_dir = tp_model_dirs[model]
    want = reference(model_dir)
    # TP = 2 schedules asynchronously (each rank feeds its own sampled tokens to the next step
    # on the device), TP = 4 synchronously.
    llm = LLM(model=model_dir, tensor_parallel_size=tp_size, async_scheduling=tp_size == 2,
              **BASE, **PREEMPTING)
    try:
        pids = worker_pids(llm)
        assert len(set(pids)) == tp_size
        spec = llm.llm_engine.engine_core.executor.kv_cache_spec
        kv_heads = llm.llm_engine.hf_config.num_key_value_heads
        assert (spec.tp_rank, spec.tp_size, spec.num_kv_heads) == (
            0, tp_size, max(1, kv_heads // tp_size))
        assert greedy(llm) == want
        scheduler = llm.llm_engine.scheduler
        assert scheduler.num_preemptions_total > 0
        assert_all_blocks_back(llm)
        assert greedy(llm) == want  # again, over the prefix cache
        assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0
        assert_all_blocks_back(llm)
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "ranks outlived shutdown"
        time.sleep(0.05)


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_expert_parallel_at_tp2_gives_transformers_greedy_ids(
        tp_model_dirs: dict[str, str], model: str) -> None:
    """--enable-expert-parallel: each rank holds half of every MoE layer's experts whole (8 or
    6, 2 a token), routes every token over all of them and runs its own; the all-reduce sums
    the halves. Greedy ids, preempting, equal transformers' and TP 1's (which TP 2 without EP
    equals: the test above)."""
    from tests.engine.test_generate_matches_hf import hf_greedy

    model_dir = tp_model_dirs[model]
    llm = LLM(model=model_dir, tensor_parallel_size=2, enable_expert_parallel=True, **BASE,
              **PREEMPTING)
    try:
        assert llm.llm_engine.config.parallel_config.enable_expert_parallel
        got = greedy(llm)
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
        assert_all_blocks_back(llm)
    finally:
        llm.shutdown()
    assert got == reference(model_dir)
    assert got == [hf_greedy(model_dir, tuple(p), MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_at_tp2_gives_tp1_s_greedy_ids(arch: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank dequantizes its rows of the column-parallel weights (llama's q / k rows
    de-interleaved per head; Qwen2's q / k / v biases) and its columns of the row-parallel
    ones, in every tensor type."""
    from sluice.model.gguf_loader import SUPPORTED_TENSOR_TYPES
    from tests.conftest import save_hf_model
    from tests.model.gguf_files import write_gguf

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    hf = save_hf_model(str(tmp_path / "hf"), arch, hidden_size=256, intermediate_size=512,
                       head_dim=64)
    path = write_gguf(hf, str(tmp_path / f"{arch}.gguf"), list(SUPPORTED_TENSOR_TYPES))
    want = greedy(LLM(model=path, tokenizer=hf, **BASE))
    llm = LLM(model=path, tokenizer=hf, tensor_parallel_size=2, **BASE, **PREEMPTING)
    try:
        assert greedy(llm) == want
        assert_all_blocks_back(llm)
    finally:
        llm.shutdown()


def test_an_fp8_kv_cache_at_tp2_gives_tp1_s_greedy_ids(qwen3_dir: str) -> None:
    """Each rank's cache of its heads is 8-bit (the setting reaches the worker processes) and
    the ids are those of one process with the same cache dtype, preempting."""
    want = greedy(LLM(model=qwen3_dir, kv_cache_dtype="fp8", **BASE))
    llm = LLM(model=qwen3_dir, tensor_parallel_size=2, kv_cache_dtype="fp8", **BASE,
              **PREEMPTING)
    try:
        assert llm.llm_engine.engine_core.executor.kv_cache_spec.dtype == "float8_e4m3fn"
        assert greedy(llm) == want
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
        assert_all_blocks_back(llm)
    finally:
        llm.shutdown()


def test_seeded_sampling_and_logprobs_equal_tp1(qwen3_dir: str, qwen3_tp2: LLM) -> None:
    """Every rank samples from the same gathered logits with the same seeds (the executor
    fails the engine if the ranks' tokens ever differ); the tokens and logprobs are TP = 1's."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed, max_tokens=12,
                             ignore_eos=True, logprobs=3, prompt_logprobs=2)
              for seed in range(3)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    want = LLM(model=qwen3_dir, **BASE).generate(prompts, params, use_tqdm=False)
    got = qwen3_tp2.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for got_pos, want_pos in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert got_pos.keys() == want_pos.keys()
            for token in want_pos:
                assert got_pos[token].logprob == pytest.approx(want_pos[token].logprob, abs=1e-4)
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for got_pos, want_pos in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert {t: round(lp.logprob, 3) for t, lp in got_pos.items()} == pytest.approx(
                {t: round(lp.logprob, 3) for t, lp in want_pos.items()}, abs=2e-3)
    # Unseeded rows draw from the engine's generator, the same on every rank.
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    assert len(qwen3_tp2.generate(prompts, unseeded, use_tqdm=False)) == 3
    assert_all_blocks_back(qwen3_tp2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eagle_speculation_at_tp2_keeps_greedy_ids(qwen3_dir: str, tmp_path,
                                                   async_scheduling: bool) -> None:
    """The EAGLE head is replicated on each rank; it shares the target's vocab-parallel
    embedding and LM head (their collectives run on every rank in the same order), also in
    its device pass after every step (async scheduling)."""
    eagle = make_tiny_eagle(qwen3_dir, str(tmp_path / "eagle"))
    llm = LLM(model=qwen3_dir, tensor_parallel_size=2, **BASE,
              async_scheduling=async_scheduling, speculative_config={
        "method": "eagle", "model": eagle, "num_speculative_tokens": 3,
        "disable_by_batch_size": None, "min_accepted_tokens_per_step": 0})
    try:
        assert greedy(llm) == reference(qwen3_dir)
        assert llm.get_spec_decoding_stats().num_draft_tokens > 0
        assert_all_blocks_back(llm)
    finally:
        llm.shutdown()


def test_cpu_tier_at_tp2_saves_and_loads_each_ranks_heads(qwen3_dir: str) -> None:
    """A connector at TP > 1: every rank moves its own KV heads under the same block ids
    (KVCacheSpec carries the rank, the size and the rank's heads)."""
    llm = LLM(model=qwen3_dir, tensor_parallel_size=2, kv_offloading_size=0.01, **BASE)
    try:
        spec = llm.llm_engine.engine_core.executor.kv_cache_spec
        assert (spec.tp_rank, spec.tp_size, spec.num_kv_heads) == (0, 2, 1)
        want = reference(qwen3_dir)
        assert greedy(llm) == want
        assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
        assert greedy(llm) == want  # every full block from the CPU tier
        assert llm.llm_engine.scheduler.connector.get_stats()["loaded_blocks"] > 0
        assert_all_blocks_back(llm)
    finally:
        llm.shutdown()


def test_ranks_that_sample_other_tokens_fail_the_engine() -> None:
    """The executor's guard: rank 0's tokens are the step's, and a rank that drew others
    would feed the next step other inputs."""
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.world_size = 2
    executor._dead_error = None
    executor._workers = _StoppedWorkers()
    same = [ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], [7]])
            for _ in range(2)]
    assert executor._merge(same).sampled_token_ids == [[5], [7]]
    other = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], [8]])
    with pytest.raises(EngineDeadError, match=r"worker rank 1 sampled other tokens than rank 0 "
                                              r"\(\[\[5\], \[8\]\] != \[\[5\], \[7\]\]\)"):
        executor._merge([same[0], other])
    assert executor._workers.terminated


class _StoppedWorkers:
    terminated = False

    def terminate(self) -> None:
        self.terminated = True


@pytest.mark.serial  # a time bound: alone, not beside the file's other tests
def test_a_killed_rank_ends_the_engine_within_5_s_and_stops_the_others(
        qwen3_dir: str) -> None:
    llm = LLM(model=qwen3_dir, tensor_parallel_size=2, **BASE)
    try:
        engine = llm.llm_engine
        engine.add_request("victim", {"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(temperature=0.0, max_tokens=140, ignore_eos=True))
        engine.step()
        pids = worker_pids(llm)
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"worker rank 1 \(pid {pids[1]}\) exited "
                                                  r"with status -9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - killed_at < 5.0
        # Rank 0, maybe blocked in a collective with the dead rank, is stopped by the executor
        # without waiting for shutdown.
        while alive(pids[0]):
            assert time.monotonic() - killed_at < 5.0, "rank 0 outlived its peer by 5 s"
            time.sleep(0.02)
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            engine.step()
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("overrides", "size", "message"), [
    ({}, 3, r"tensor_parallel_size \(3\) must divide the model's num_attention_heads \(4\)"),
    ({}, 8, r"tensor_parallel_size \(8\) must divide the model's num_attention_heads \(4\)"),
    (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16), 2,
     r"tensor_parallel_size \(2\) must divide the model's num_key_value_heads \(3\)"),
    (dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=3, head_dim=8), 4,
     r"fewer key/value heads \(3\) than tensor_parallel_size \(4\)"),
    (dict(intermediate_size=130), 4,
     r"tensor_parallel_size \(4\) must divide the model's intermediate_size \(130\)"),
])
def test_sizes_the_model_cannot_split_are_value_errors_naming_both_numbers(
        tmp_path, overrides: dict, size: int, message: str) -> None:
    from tests.tiny_models import save_hf_model

    model_dir = (save_hf_model(str(tmp_path), "llama", **overrides) if overrides else None)
    args = EngineArgs(model=model_dir or _tiny_dir(tmp_path), tensor_parallel_size=size,
                      device="cpu")
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()


def test_more_ranks_than_visible_gpus_is_a_value_error(
        qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = EngineArgs(model=qwen3_dir, tensor_parallel_size=2, device="cuda")
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) exceeds the visible "
                                         r"GPUs \(1\)"):
        args.create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineArgs(model=qwen3_dir, tensor_parallel_size=0).create_engine_config()


def _tiny_dir(tmp_path) -> str:
    from tests.tiny_models import save_hf_model

    return save_hf_model(str(tmp_path), "qwen3")


def test_profile_window_on_every_rank(qwen3_tp2: LLM) -> None:
    """LLM.start_profile / stop_profile: a torch.profiler window in each worker process, one
    summary per rank, each counting the steps it ran; a second start or a stop without a start
    is refused in the engine's process, the workers untouched."""
    qwen3_tp2.start_profile()
    with pytest.raises(RuntimeError, match="a profile is already running"):
        qwen3_tp2.start_profile()
    qwen3_tp2.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    summaries = qwen3_tp2.stop_profile()
    assert [s.rank for s in summaries] == [0, 1]
    assert summaries[0].steps == summaries[1].steps >= 4  # a prefill and three decodes
    assert all(s.host_ops for s in summaries)
    with pytest.raises(RuntimeError, match="no profile is running"):
        qwen3_tp2.stop_profile()
    assert_all_blocks_back(qwen3_tp2)
