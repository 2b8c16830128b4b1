"""Sliding-window models end to end: greedy ids equal transformers' (eager attention, float32)
for prompts and generations well past the window, with prefix caching, chunked prefill and
preemption on, and at TP 2; a prefix hit is served by the blocks its window sees after the
prefix's first blocks were reused; a model whose every layer is windowed (Mistral, Phi-3) holds only
the blocks its window can see; a model with global layers (Gemma 3: here one windowed layer and
one global, two KV cache groups of one layer) frees its windowed group's blocks behind the
window and keeps its global group's (more in tests/engine/test_hybrid_kv_cache.py).

Windows: 20 positions over 8-token blocks (not a multiple of the block size) and 16 over
16-token blocks; chunks of 16 tokens, so a chunk's first query sees keys of earlier chunks."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.core.request import Request
from sluice.engine.core import freeing_window
from sluice.engine.core_proc import make_scheduler_stats
from sluice.model.hf_config import parse_hf_config
from tests.tiny_models import save_hf_model

MAX_TOKENS = 40
PROMPT_LENS = (5, 23, 40, 77, 61)


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 600) for _ in range(n)] for n in PROMPT_LENS]
    return prompts + [prompts[3][:64] + [7, 8, 9]]  # shares 8 blocks of 8 with the 77-token one


PROMPTS = make_prompts()
# arch -> (window, block size)
WINDOWED = {"mistral": (20, 8), "phi3": (16, 16), "gemma3": (20, 8)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("swa")
    return {arch: save_hf_model(str(root / f"{arch}-w{window}"), arch, sliding_window=window)
            for arch, (window, _) in WINDOWED.items()}


@functools.cache
def hf_eager_greedy(folder: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.sliding_window == WINDOWED[Path(folder).name.split("-")[0]][0]
    input_ids = torch.tensor([prompt])
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                           min_new_tokens=0, eos_token_id=1 << 30,
                                           pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=config)
    return out[0, len(prompt):].tolist()


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS,
           max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def reference(folder: str, prompts: list[list[int]] = PROMPTS,
              max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return [hf_eager_greedy(folder, tuple(p), max_tokens) for p in prompts]


def assert_all_blocks_back(llm: LLM) -> None:
    manager = llm.llm_engine.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1
    assert not llm.llm_engine.scheduler.has_unfinished_requests()


def engine(folder: str, arch: str, **kwargs: object) -> LLM:
    _, block_size = WINDOWED[arch]
    return LLM(**{"model": folder, "dtype": "float32", "block_size": block_size,
                  "max_model_len": 256, "max_num_batched_tokens": 16, **kwargs})


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_greedy_ids_equal_transformers_past_the_window(folders: dict[str, str],
                                                       arch: str) -> None:
    """Prefix caching and 16-token chunks on; the second pass is served by the prefix cache
    (blocks freed behind the window stay cached until evicted)."""
    folder = folders[arch]
    llm = engine(folder, arch)
    assert llm.llm_engine.scheduler_config.max_model_len == 256  # no longer held to the window
    want = reference(folder)
    assert greedy(llm) == want
    assert_all_blocks_back(llm)
    manager = llm.llm_engine.kv_cache_manager
    hits_before = manager.prefix_cache_hits
    assert hits_before > 0  # the shared 64-token prefix
    assert greedy(llm) == want  # again, over the prefix cache
    assert manager.prefix_cache_hits > hits_before
    assert_all_blocks_back(llm)
    freed = make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks
    assert freed > 0
    if arch == "gemma3":  # the windowed layer's group frees, the global layer's keeps all
        assert manager.sliding_window is None
        assert manager.groups.windows == (None, WINDOWED[arch][0])
    else:
        assert manager.sliding_window == WINDOWED[arch][0]
    llm.shutdown()


def record_window_hits(llm: LLM) -> list[int]:
    """Wrap the engine's prefix lookup: the list returned gets the hit tokens of every lookup
    served by a window (a windowed group's hit with null blocks before its window)."""
    manager = llm.llm_engine.kv_cache_manager
    lookup, window_hits = manager.get_computed_blocks, []

    def recording_lookup(request: Request):  # noqa: ANN202
        hits, num_tokens = lookup(request)
        groups = hits if hasattr(manager, "managers") else [hits]
        if any(group and group[0].is_null for group in groups):
            window_hits.append(num_tokens)
        return hits, num_tokens

    manager.get_computed_blocks = recording_lookup
    return window_hits


def assert_a_window_hit_after_the_roots_are_reused(llm: LLM, folder: str,
                                                  num_other_tokens: int) -> None:
    """A 77-token prompt, then an unrelated one of `num_other_tokens` whose blocks evict the
    first's first blocks in every windowed group (freed behind the window, they head the free
    queue), then a prompt sharing the first's 72 tokens: it hits all 72 (the walk from block 0
    would hit none), computes its other 30 in two chunks, and its ids are transformers'."""
    rng = random.Random(1)
    first = PROMPTS[3]
    second = first[:72] + [rng.randrange(3, 600) for _ in range(30)]
    other = [rng.randrange(3, 600) for _ in range(num_other_tokens)]
    assert greedy(llm, [first], 1) == reference(folder, [first], 1)
    assert greedy(llm, [other], 1) == reference(folder, [other], 1)
    manager = llm.llm_engine.kv_cache_manager
    windowed = ([manager] if manager.sliding_window is not None
                else [m for m in manager.managers if m.sliding_window is not None])
    probe = Request("probe", second, SamplingParams())
    manager.update_block_hashes(probe)
    for group in windowed:
        assert group.block_pool.get_cached_block(probe.block_hashes[0], group.group) is None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [output] = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)
    assert output.num_cached_tokens == 72
    assert output.outputs[0].token_ids == reference(folder, [second], 8)[0]
    assert_all_blocks_back(llm)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_shared_prefix_hits_its_window_after_its_first_blocks_are_reused(
        folders: dict[str, str], arch: str) -> None:
    """A cache of 128 tokens' blocks (Gemma 3: a global group's and a windowed group's
    window and step): an unrelated 64-token prompt (Gemma 3: 17, which takes 3 blocks a
    group) reaches past the blocks never used into the first prompt's."""
    folder = folders[arch]
    mistral = arch == "mistral"
    llm = engine(folder, arch, max_model_len=128, num_gpu_blocks_override=17 if mistral else 24)
    assert_a_window_hit_after_the_roots_are_reused(llm, folder, 64 if mistral else 17)
    llm.shutdown()


def assert_preempted_requests_keep_the_output_over_window_hits(llm: LLM, folder: str) -> None:
    """Six prompts sharing 72 tokens (past the window) in a cache too small for them at once:
    later ones and resumed ones hit only their windows' blocks (null before them), in 16-token
    chunks after the hit, and every output is transformers'."""
    rng = random.Random(2)
    prompts = [PROMPTS[3][:72] + [rng.randrange(3, 600) for _ in range(rng.randrange(5, 20))]
               for _ in range(6)]
    window_hits = record_window_hits(llm)
    assert greedy(llm, prompts, 12) == reference(folder, prompts, 12)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert len(window_hits) >= 5 and max(window_hits) >= 72
    assert_all_blocks_back(llm)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_greedy_ids_equal_transformers_under_preemption_over_window_hits(
        folders: dict[str, str], arch: str) -> None:
    folder = folders[arch]
    """The smallest cache for 104 tokens (Gemma 3: a global group's and a windowed group's
    window and step)."""
    llm = engine(folder, arch, max_model_len=104,
                 num_gpu_blocks_override=14 if arch == "mistral" else 21)
    assert_preempted_requests_keep_the_output_over_window_hits(llm, folder)
    llm.shutdown()


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_greedy_ids_equal_transformers_under_preemption(folders: dict[str, str],
                                                        arch: str) -> None:
    """A cache too small for every request at once: one 64-token request's worth of blocks
    of 8 tokens (Gemma 3: in each of its 2 KV cache groups)."""
    folder = folders[arch]
    llm = engine(folder, arch, max_model_len=64,
                 num_gpu_blocks_override=17 if arch == "gemma3" else 10)
    prompts = [p[:48] for p in PROMPTS]
    max_tokens = 16
    assert greedy(llm, prompts, max_tokens) == reference(folder, prompts, max_tokens)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_all_blocks_back(llm)
    llm.shutdown()


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_an_all_windowed_model_holds_only_its_window_s_blocks(folders: dict[str, str],
                                                              arch: str) -> None:
    """One request of 77 + 100 tokens: it would need 23 blocks of 8 (12 of 16) with every block
    kept; behind a 20-token window (16) with 16-token chunks it never holds more than the
    blocks of the window and a chunk, the engine's counters say (the numbers /debug/engine
    shows), and its output is transformers'."""
    folder = folders[arch]
    window, block_size = WINDOWED[arch]
    llm = engine(folder, arch)
    prompt, max_tokens = PROMPTS[3], 100
    assert greedy(llm, [prompt], max_tokens) == reference(folder, [prompt], max_tokens)
    stats = make_scheduler_stats(llm.llm_engine.engine_core)
    full_context = -(-(len(prompt) + max_tokens) // block_size)
    # the window before the chunk's first token, the chunk, a block boundary either side
    bound = -(-(window - 1 + 16) // block_size) + 1
    assert stats.peak_blocks_per_request <= bound < full_context
    assert stats.peak_blocks_in_use == stats.peak_blocks_per_request  # one request
    assert stats.num_window_freed_blocks >= full_context - bound
    assert stats.num_free_blocks == stats.num_blocks  # all back
    assert_all_blocks_back(llm)
    llm.shutdown()


def test_prefix_caching_off_and_no_chunks_keep_the_output(folders: dict[str, str]) -> None:
    """Without prefix caching blocks are freed as soon as they leave the window; without
    chunked prefill a whole prompt is one step (its blocks all held for it, then freed)."""
    folder = folders["mistral"]
    want = reference(folder)
    for kwargs in (dict(enable_prefix_caching=False),
                   dict(enable_chunked_prefill=False, max_num_batched_tokens=256)):
        llm = engine(folder, "mistral", **kwargs)
        assert greedy(llm) == want
        assert make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks > 0
        assert_all_blocks_back(llm)
        llm.shutdown()


@pytest.mark.parametrize("kwargs", [
    dict(async_scheduling=True),
    dict(async_scheduling=True, max_model_len=64, num_gpu_blocks_override=10),
    dict(async_scheduling=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": None,
        "min_accepted_tokens_per_step": 0})],
    ids=["async", "async-preempting", "async-ngram"])
def test_async_scheduling_keeps_the_output(folders: dict[str, str], kwargs: dict) -> None:
    """The next step is scheduled (and blocks behind the window freed) before the last one's
    tokens are back, with preemption and with n-gram drafts counted as accepted in flight."""
    folder = folders["mistral"]
    prompts = [p[:48] for p in PROMPTS] if "num_gpu_blocks_override" in kwargs else PROMPTS
    max_tokens = 16 if "num_gpu_blocks_override" in kwargs else MAX_TOKENS
    llm = engine(folder, "mistral", **kwargs)
    assert greedy(llm, prompts, max_tokens) == reference(folder, prompts, max_tokens)
    if "num_gpu_blocks_override" in kwargs:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks > 0
    assert_all_blocks_back(llm)
    llm.shutdown()


def test_ngram_speculation_keeps_the_blocks_its_drafts_may_roll_back(
        folders: dict[str, str]) -> None:
    """n-gram drafts: the manager keeps k more positions than the window (a rejected draft
    moves num_computed_tokens back); a draft-model proposer would keep every block."""
    folder = folders["mistral"]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3, "disable_by_batch_size": None,
             "min_accepted_tokens_per_step": 0}
    llm = engine(folder, "mistral", speculative_config=ngram)
    assert llm.llm_engine.kv_cache_manager.sliding_window == 20 + 3
    assert greedy(llm) == reference(folder)
    assert_all_blocks_back(llm)
    llm.shutdown()


def test_a_kv_connector_keeps_every_block_and_the_output(folders: dict[str, str]) -> None:
    """A connector reads or sends a request's blocks whole (here the CPU tier, which stores
    each full block and loads prefixes back): no block is freed behind the window, and the
    output is still transformers'."""
    folder = folders["mistral"]
    llm = engine(folder, "mistral", kv_offloading_size=0.01)
    assert llm.llm_engine.kv_cache_manager.sliding_window is None
    want = reference(folder)
    assert greedy(llm) == want
    llm.llm_engine.drain_kv_transfers()
    assert llm.reset_prefix_cache()  # the GPU's prefixes gone: the tier serves them
    assert greedy(llm) == want
    assert llm.llm_engine.scheduler.connector.get_stats()["hit_blocks"] > 0
    llm.llm_engine.drain_kv_transfers()
    assert_all_blocks_back(llm)
    assert make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks == 0
    llm.shutdown()


def test_which_models_and_settings_free_blocks_behind_the_window() -> None:
    """Every layer windowed and nothing else reading older blocks: the window (+ k with n-gram
    drafts); a connector or a model proposer: None (every block kept); a global layer beside
    windowed ones: None for one manager (the model's KV cache groups are split instead:
    tests/core/test_hybrid_kv_cache_manager.py)."""
    from types import SimpleNamespace

    base = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "sliding_window": 20}
    mistral = parse_hf_config(base)
    gemma_mixed = parse_hf_config({
        **base, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "layer_types": ["sliding_attention", "full_attention"]})
    gemma_local = parse_hf_config({
        **base, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "layer_types": ["sliding_attention"] * 2})

    def window(hf_config, spec=None, kv_transfer_config=None):  # noqa: ANN001, ANN202
        return freeing_window(SimpleNamespace(
            hf_config=hf_config, kv_transfer_config=kv_transfer_config,
            scheduler_config=SimpleNamespace(speculative_config=spec,
                                            max_model_len=256)))

    assert window(mistral) == 20
    assert window(gemma_local) == 20
    assert window(gemma_mixed) is None
    assert window(parse_hf_config({**base, "sliding_window": None})) is None
    assert window(mistral, SimpleNamespace(method="ngram", num_speculative_tokens=3)) == 23
    assert window(mistral, SimpleNamespace(method="eagle", num_speculative_tokens=3)) is None
    assert window(mistral, SimpleNamespace(method="draft_model", num_speculative_tokens=3)) is None
    assert window(mistral, kv_transfer_config=object()) is None


@pytest.mark.one_worker
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_tp2_greedy_ids_equal_transformers(folders: dict[str, str], arch: str) -> None:
    folder = folders[arch]
    llm = engine(folder, arch, tensor_parallel_size=2)
    try:
        assert greedy(llm) == reference(folder)
        assert_all_blocks_back(llm)
    finally:
        llm.shutdown()
