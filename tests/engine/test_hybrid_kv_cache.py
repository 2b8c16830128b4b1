"""Gemma 3's hybrid KV cache end to end: a tiny random Gemma 3 of 6 layers (2 windowed, 1
global, twice) splits into 3 KV cache groups of 2 layers (1 global, 2 windowed), which share 2
KV tensors; each windowed group frees its blocks behind the 20-token window while the global
group keeps every block. Greedy ids equal transformers' (eager attention, float32) past the
window with prefix caching, 16-token chunks, preemption, aborts and async scheduling, and
over prefix hits whose windowed groups hold only their windows' blocks (their first blocks
reused); the cache holds fewer blocks than full context would need; every block comes back.
(The 2-layer Gemma 3 of tests/engine/test_sliding_window.py is 2 groups of 1, at TP 2 too.)"""

from __future__ import annotations

import random

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.config import CacheConfig, SchedulerConfig
from sluice.core.hybrid_kv_cache_manager import HybridKVCacheManager
from sluice.core.kv_cache_groups import KVCacheGroups
from sluice.engine.core_proc import make_scheduler_stats
from sluice.engine.processors import RequestOutputKind
from sluice.model.hf_config import load_hf_config
from sluice.worker.kv_cache import determine_num_blocks
from tests.engine.test_sliding_window import (
    PROMPTS,
    assert_a_window_hit_after_the_roots_are_reused,
    assert_all_blocks_back,
    assert_preempted_requests_keep_the_output_over_window_hits,
    engine,
    greedy,
    reference,
)
from tests.tiny_models import save_hf_model

WINDOW, BLOCK_SIZE = 20, 8
LAYER_TYPES = (["sliding_attention"] * 2 + ["full_attention"]) * 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    # named gemma3-w20-...: test_sliding_window's reference reads the window off the name
    return save_hf_model(str(tmp_path_factory.mktemp("hybrid") / "gemma3-w20-l6"), "gemma3",
                         sliding_window=WINDOW, num_hidden_layers=6, layer_types=LAYER_TYPES)


def hybrid_engine(folder: str, **kwargs: object) -> LLM:
    llm = engine(folder, "gemma3", **kwargs)
    manager = llm.llm_engine.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager)
    assert manager.groups == KVCacheGroups(windows=(None, WINDOW, WINDOW),
                                           layers=((2, 5), (0, 1), (3, 4)))
    return llm


def test_layers_share_two_kv_tensors_and_read_their_group_s_tables(folder: str) -> None:
    llm = hybrid_engine(folder)
    runner = llm.llm_engine.engine_core.executor.model_runner
    caches = list(runner.kv_caches.values())
    assert len({cache.data_ptr() for cache in caches}) == 2  # the groups' size
    # layer j of every group: layers 0, 2 and 3 on tensor 0; 1, 4 and 5 on tensor 1
    assert {caches[i].data_ptr() for i in (0, 2, 3)} == {caches[0].data_ptr()}
    assert {caches[i].data_ptr() for i in (1, 4, 5)} == {caches[1].data_ptr()}
    layers = [m for m in runner.model.modules() if type(m).__name__ == "Attention"]
    assert [layer.kv_group for layer in layers] == [1, 1, 0, 2, 2, 0]
    assert runner.block_tables.tables.shape[0] == 3
    llm.shutdown()


def test_greedy_ids_equal_transformers_with_prefix_caching_and_chunks(folder: str) -> None:
    """The second pass hits the prefix cache in every group (blocks freed behind the window
    stay cached until reused); the output stays transformers'."""
    llm = hybrid_engine(folder)
    want = reference(folder)
    assert greedy(llm) == want
    assert_all_blocks_back(llm)
    manager = llm.llm_engine.kv_cache_manager
    hits_before = manager.prefix_cache_hits
    assert hits_before > 0  # the shared 64-token prefix
    assert greedy(llm) == want  # again, over the prefix cache
    assert manager.prefix_cache_hits > hits_before
    assert make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks > 0
    assert_all_blocks_back(llm)
    llm.shutdown()


def test_a_repeated_long_prompt_hits_and_keeps_the_output(folder: str) -> None:
    prompt = PROMPTS[3]  # 77 tokens: 9 full blocks, past the window
    llm = hybrid_engine(folder)
    want = reference(folder, [prompt])
    assert greedy(llm, [prompt]) == want
    manager = llm.llm_engine.kv_cache_manager
    hits_before = manager.prefix_cache_hits
    assert greedy(llm, [prompt]) == want
    assert manager.prefix_cache_hits - hits_before == 9 * BLOCK_SIZE
    assert_all_blocks_back(llm)
    llm.shutdown()


def test_a_shared_prefix_hits_every_group_after_the_windowed_roots_are_reused(
        folder: str) -> None:
    """30 usable blocks, as many as the first 77-token prompt takes (10 a group): a 17-token
    prompt's 9 blocks are the windowed groups' first, freed behind the window; the shared
    72 tokens then still hit in all 3 groups (the hit is the global group's chain and each
    windowed group's window, found by shrinking until both windowed groups agree)."""
    llm = hybrid_engine(folder, max_model_len=128, num_gpu_blocks_override=31)
    assert_a_window_hit_after_the_roots_are_reused(llm, folder, 17)
    llm.shutdown()


def test_the_windowed_groups_hold_only_their_window_s_blocks(folder: str) -> None:
    """One request of 77 + 100 tokens: 23 blocks of 8 a group, 69 in all with every block
    kept; the global group keeps its 23, each windowed group never more than the window and a
    chunk (the numbers /debug/engine shows)."""
    llm = hybrid_engine(folder)
    prompt, max_tokens = PROMPTS[3], 100
    assert greedy(llm, [prompt], max_tokens) == reference(folder, [prompt], max_tokens)
    stats = make_scheduler_stats(llm.llm_engine.engine_core)
    full_context = -(-(len(prompt) + max_tokens) // BLOCK_SIZE)
    window_bound = -(-(WINDOW - 1 + 16) // BLOCK_SIZE) + 1
    assert stats.peak_blocks_per_request <= full_context + 2 * window_bound < 3 * full_context
    assert stats.num_window_freed_blocks >= 2 * (full_context - window_bound)
    assert stats.peak_blocks_in_use == stats.peak_blocks_per_request
    assert_all_blocks_back(llm)
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_ids_equal_transformers_under_preemption(folder: str,
                                                        async_scheduling: bool) -> None:
    """24 usable blocks: a 64-token request holds 8 in the global group, 4 to 8 in each
    windowed one."""
    llm = hybrid_engine(folder, max_model_len=64, num_gpu_blocks_override=25,
                        async_scheduling=async_scheduling)
    prompts = [p[:48] for p in PROMPTS]
    assert greedy(llm, prompts, 16) == reference(folder, prompts, 16)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_all_blocks_back(llm)
    llm.shutdown()


def test_greedy_ids_equal_transformers_under_preemption_over_window_hits(folder: str) -> None:
    llm = hybrid_engine(folder, max_model_len=104, num_gpu_blocks_override=28)
    assert_preempted_requests_keep_the_output_over_window_hits(llm, folder)
    llm.shutdown()


def test_async_scheduling_keeps_the_output(folder: str) -> None:
    llm = hybrid_engine(folder, async_scheduling=True)
    assert greedy(llm) == reference(folder)
    assert make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks > 0
    assert_all_blocks_back(llm)
    llm.shutdown()


def test_prefix_caching_off_and_no_chunks_keep_the_output(folder: str) -> None:
    want = reference(folder)
    for kwargs in (dict(enable_prefix_caching=False),
                   dict(enable_chunked_prefill=False, max_num_batched_tokens=256)):
        llm = hybrid_engine(folder, **kwargs)
        assert greedy(llm) == want
        assert make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks > 0
        assert_all_blocks_back(llm)
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_aborts_and_preemption_return_every_block(folder: str, async_scheduling: bool) -> None:
    llm = hybrid_engine(folder, max_model_len=96, num_gpu_blocks_override=60, max_num_seqs=6,
                        async_scheduling=async_scheduling)
    core = llm.llm_engine
    rng = random.Random(0)
    shared = [rng.randrange(3, 600) for _ in range(40)]
    live: set[str] = set()
    finished = 0
    for i in range(50):
        if rng.random() < 0.6:
            tokens = (shared[:rng.randrange(0, 40)]
                      + [rng.randrange(3, 600) for _ in range(rng.randrange(1, 30))])
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 30),
                                    ignore_eos=True)
            live.add(core.add_request(f"r{i}", {"prompt_token_ids": tokens}, params,
                                      RequestOutputKind.DELTA))
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            core.abort_request(victim)
            live.discard(victim)
        for out in core.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
        core.kv_cache_manager.check_integrity()
    while core.has_unfinished_requests():
        for out in core.step():
            finished += out.finished
    assert finished > 10
    assert core.scheduler.num_preemptions_total > 0
    assert make_scheduler_stats(core.engine_core).num_window_freed_blocks > 0
    assert_all_blocks_back(llm)
    llm.shutdown()


def test_kv_cache_sizing_counts_a_group_s_layers_per_block(folder: str) -> None:
    """A block is a page of one group's 2 layers, not of all 6: the same bytes hold 3 times
    the blocks."""
    hf_config = load_hf_config(folder)
    per_layer = 2 * BLOCK_SIZE * 2 * 16 * 4  # K and V, 2 KV heads of 16 dims, float32
    cache = CacheConfig(block_size=BLOCK_SIZE, cpu_kv_cache_bytes=600 * 6 * per_layer)
    scheduler = SchedulerConfig(max_model_len=256, max_num_seqs=256,
                                max_num_batched_tokens=256)
    groups = KVCacheGroups(windows=(None, WINDOW, WINDOW), layers=((2, 5), (0, 1), (3, 4)))
    cpu = torch.device("cpu")
    assert determine_num_blocks(cache, scheduler, hf_config, torch.float32, cpu) == 600
    assert determine_num_blocks(cache, scheduler, hf_config, torch.float32, cpu,
                                kv_groups=groups) == 1800
    llm = hybrid_engine(folder, cpu_kv_cache_bytes=600 * 6 * per_layer)
    assert llm.llm_engine.kv_cache_manager.block_pool.num_blocks == 1800
    runner = llm.llm_engine.engine_core.executor.model_runner
    num_bytes = sum(t.numel() * t.element_size()
                    for t in {c.data_ptr(): c for c in runner.kv_caches.values()}.values())
    assert num_bytes == 1800 * 2 * per_layer
    llm.shutdown()


def test_a_cache_too_small_for_one_request_is_refused_at_start(folder: str) -> None:
    """64 tokens of 8: 8 blocks in the global group, at most 7 (the window and a 16-token
    step) in each windowed one."""
    with pytest.raises(ValueError, match=r"max_model_len \(64\) needs 22 KV blocks but the "
                                         r"cache has 20"):
        engine(folder, "gemma3", max_model_len=64, num_gpu_blocks_override=21)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_emulated_cuda_graph_replays_read_every_group_s_tables(
        folder: str, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph runner's path on a CPU (tests/worker/test_graph_runner.py's emulation: each
    size's captured inputs are views of the fixed buffers, replayed through the model): the
    graph-read tables of every group, filled per step, and groups 1..'s slots laid out for the
    graph's size keep transformers' ids for decode, one-prompt and mixed steps."""
    from sluice.worker import graph_runner
    from tests.worker.test_graph_runner import EmulatedGraphs

    monkeypatch.setattr(graph_runner, "DecodeGraphs", EmulatedGraphs)
    llm = hybrid_engine(folder, max_num_seqs=8, max_num_batched_tokens=64,
                        async_scheduling=async_scheduling)
    runner = llm.llm_engine.engine_core.executor.model_runner
    builder, graphs = runner.input_builder, runner.graph_runner
    builder.graph_group_block_tables = torch.zeros(
        (3, 8, builder.block_tables.max_blocks_per_req), dtype=torch.int32)
    builder.graph_block_tables = builder.graph_group_block_tables[0]
    graphs.capture(runner.model)
    assert greedy(llm) == reference(folder)
    prompt = PROMPTS[3]
    for _ in range(2):  # a lone prompt, then over its cached prefix: the prefill graphs
        assert greedy(llm, [prompt]) == reference(folder, [prompt])
    assert all(s.num_replays > 0
               for s in (graphs.graphs, graphs.prefill_graphs, graphs.mixed_graphs))
    assert make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks > 0
    assert_all_blocks_back(llm)
    llm.shutdown()


@pytest.mark.one_worker
def test_tp2_greedy_ids_equal_transformers(folder: str) -> None:
    llm = hybrid_engine(folder, tensor_parallel_size=2)
    try:
        assert greedy(llm) == reference(folder)
        assert make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks > 0
        assert_all_blocks_back(llm)
    finally:
        llm.shutdown()


def test_padded_groups_of_a_model_whose_counts_share_no_divisor_keep_the_output(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """17 layers, 14 windowed and 3 global (coprime, as Gemma 3 4B's 29 and 5): 6 groups of 3
    over 3 KV tensors, the last windowed group of 2 layers (its third tensor's pages unused),
    where the common divisor would give 17 groups; greedy ids equal transformers' past the
    window, over the prefix cache, and every block comes back."""
    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 2 + (
        ["sliding_attention"] * 4 + ["full_attention"])
    folder = save_hf_model(str(tmp_path_factory.mktemp("padded") / "gemma3-w20-l17"),
                           "gemma3", sliding_window=WINDOW, num_hidden_layers=17,
                           layer_types=layer_types)
    llm = engine(folder, "gemma3")
    manager = llm.llm_engine.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager)
    assert manager.groups.layers == ((5, 11, 16), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13),
                                     (14, 15))
    runner = llm.llm_engine.engine_core.executor.model_runner
    assert len({cache.data_ptr() for cache in runner.kv_caches.values()}) == 3
    prompts = PROMPTS[:3]
    want = reference(folder, prompts)
    assert greedy(llm, prompts) == want
    assert greedy(llm, prompts) == want  # over the prefix cache
    assert manager.prefix_cache_hits > 0
    assert_all_blocks_back(llm)
    llm.shutdown()
