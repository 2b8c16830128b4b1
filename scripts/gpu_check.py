"""GPU check: greedy ids on CUDA (float32) equal the CPU reference for tiny Qwen3 / Llama / Qwen2
models, under every GPU optimisation (Triton attention, CUDA graphs, compiled ops, async
scheduling) and with them switched off one at a time, with and without prefix caching and
with small prefill chunks (64-token steps replay the CUDA graphs of mixed steps); and with
speculative decoding (n-gram, a draft model, an EAGLE head, each with drafts proposed on the
device under async scheduling and on the host without it; verification CUDA graphs and eager;
the drafting policy switching drafting on and off);
with the model in a worker process; with the CPU KV tier and the global KV pool (in-process,
Redis and Mooncake Store where their servers are installed: started on loopback), saved and then
loaded; through a prefill, a decode and a router (PD over the Mooncake Transfer Engine, TCP,
`--only pd`, where Mooncake is installed; and over the same-host `shm` backend, which on a GPU
is CUDA IPC, `--only pd` or `--only pd_shm`); the pool and PD
with an 8-bit cache too; and, on a machine of two or more GPUs, tensor parallelism (NCCL; the
all-reduces inside the CUDA graphs, the fused ops and folded norms per rank), with graphs on and
off; and with an 8-bit KV cache
(`kv_cache_dtype="fp8"`, and "fp8_e5m2") against the CPU reference with the same cache dtype;
with `--trained-gguf`, the trained SmolLM2 in float32 and bfloat16 (trained_model_check); FP8
checkpoints with their FP8 weights kept (fp8_weights_check, `--only fp8_weights`), and FP8
Qwen3-MoE experts kept FP8 (fp8_moe_check, `--only fp8_moe`); Mistral,
Phi-3, Gemma 3 and Qwen3-MoE (families_check, `--only families`).
Exits non-zero on any mismatch.

    PYTHONPATH=. python scripts/gpu_check.py [OUT_DIR] [--only PREFIX,...]

Writes gpu_check.json into OUT_DIR (default: benchmarks/results/gpu-check/), a record of schema
sluice.bench/1 (sluice.bench.record) whose results map each check to true, false, or a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile

import torch

from sluice import LLM, SamplingParams
from sluice.attention import triton_backend
from sluice.bench.record import make_record, write_record
from sluice.kv_transfer.offloading import BlockMover
from sluice.model.tiny import make_tiny_model
from sluice.spec_decode.eagle_model import make_tiny_eagle
from sluice.worker.cuda_graphs import DecodeGraphs

# Every optimisation on the GPU must give the CPU reference's greedy ids.
CONFIGS = {
    "default": {},  # triton attention, CUDA graphs, compiled small ops, async scheduling
    "enforce_eager": {"enforce_eager": True},
    "sync_scheduling": {"async_scheduling": False},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunks_of_32": {"max_num_batched_tokens": 32},
    # 64-token steps of a prompt chunk beside decodes: the CUDA graphs of mixed steps (64 is
    # their smallest token bucket; with 32-token steps such steps run eagerly).
    "chunks_of_64": {"max_num_batched_tokens": 64},
    "torch_ref_attention": {"attention_backend": "torch_ref", "enforce_eager": True},
    # As chunks_of_64, with ~1 ms of device sleep before every graph replay: the device trails
    # the host, as under a server's load, so a pinned buffer the host rewrites for the next
    # step before the device has copied it shows (the logits indices were such a buffer).
    "chunks_of_64_device_lagging": {"max_num_batched_tokens": 64},
    # The model in a worker process (the multiprocess executor).
    "mp_executor": {"distributed_executor_backend": "mp"},
    # The CPU KV tier: saves after graph replays and eager steps, then (the GPU prefix cache
    # emptied) layer-by-layer loads on a side stream in eager steps.
    "cpu_kv_tier": {"kv_offloading_size": 0.05},
    "cpu_kv_tier_chunks_of_64": {"kv_offloading_size": 0.05, "max_num_batched_tokens": 64},
    # As cpu_kv_tier with the device trailing the host (graph replays) and the loads trailing
    # the compute stream: a save that does not wait for its layer's store in the graph, or a
    # layer that does not wait for its load, reads the wrong KV.
    "cpu_kv_tier_device_lagging": {"kv_offloading_size": 0.05},
    # An 8-bit KV cache: against the CPU reference with the same cache dtype (every path
    # attends to K/V as the cache holds them); the default setting also decodes 24 prompts at
    # once (the fused decode kernel) and, recorded only, across 512 keys.
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "fp8_kv_enforce_eager": {"kv_cache_dtype": "fp8", "enforce_eager": True},
    "fp8_kv_chunks_of_64": {"kv_cache_dtype": "fp8", "max_num_batched_tokens": 64},
    "fp8_kv_no_prefix_caching": {"kv_cache_dtype": "fp8", "enable_prefix_caching": False},
    # The CPU tier moves the 8-bit cache as bytes: saved, then loaded (as cpu_kv_tier).
    "fp8_kv_cpu_kv_tier": {"kv_cache_dtype": "fp8", "kv_offloading_size": 0.05},
    # The other 8-bit format, float8_e5m2 (its own CPU reference).
    "fp8_e5m2_kv": {"kv_cache_dtype": "fp8_e5m2"},
    "fp8_e5m2_kv_chunks_of_64": {"kv_cache_dtype": "fp8_e5m2", "max_num_batched_tokens": 64},
}
# The global KV pool: saves after graph replays and eager steps, then (the GPU prefix cache
# emptied) every full block loaded from the pool; one setting per backend whose server is here.
POOL_BACKENDS = ("local", "redis", "mooncake", "shm")


def pool_configs(stack: contextlib.ExitStack) -> dict[str, dict]:
    from sluice.testing import servers

    configs = {}
    for backend in POOL_BACKENDS:
        # Every hit loaded (not left to the load-or-recompute choice): the load path is checked.
        extra: dict[str, object] = {"backend": backend, "staging_bytes": 64 << 20,
                                    "load_policy": "always"}
        if backend == "redis":
            if servers.redis_missing():
                continue
            extra["url"] = stack.enter_context(servers.start_redis()).url
        elif backend == "shm":
            # Slots of 4 MiB: a block of every layer of the models checked (Qwen3-8B: 2.25 MiB).
            extra["url"] = stack.enter_context(servers.start_shm_pool(
                capacity_bytes=1 << 30, slot_bytes=4 << 20)).url
        elif backend == "mooncake":
            if servers.mooncake_missing():
                continue
            master = stack.enter_context(servers.start_mooncake_master())
            stack.enter_context(servers.start_mooncake_segment_owner(master.address, 256 << 20))
            extra.update(url=master.url, global_segment_size=0)
        transfer = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": extra}
        configs[f"pool_{backend}"] = {"kv_transfer_config": transfer}
        # The same pool server holds both caches' blocks: the dtype is in every key.
        configs[f"fp8_kv_pool_{backend}"] = {"kv_cache_dtype": "fp8",
                                             "kv_transfer_config": transfer}
    return configs


def wants_pools(only: tuple[str, ...]) -> bool:
    """Whether a setting of pool_configs is among `only` (then its servers are started)."""
    names = ("pool_", "fp8_kv_pool_")
    return not only or any(n.startswith(p) or p.startswith(n) for p in only for n in names)


def pd_equals_cpu(model: str, prompts: list[dict], reference: list[list[int]],
                  kv_cache_dtype: str = "auto", backend: str = "mooncake") -> dict:
    """A prefill, a decode and a router (sluice serve processes on this GPU, KV over the
    Mooncake Transfer Engine on TCP, or `backend` shm: CUDA IPC, the decode's cache opened by
    the prefill, device-to-device copies): the completions' text equals the CPU reference's
    (made with the same `kv_cache_dtype`)."""
    import httpx
    from transformers import AutoTokenizer

    from sluice.testing.pd_cluster import start_cluster

    tokenizer = AutoTokenizer.from_pretrained(model)
    flags = ["--device", "cuda", "--dtype", "float32", "--gpu-memory-utilization", "0.2",
             "--kv-cache-dtype", kv_cache_dtype]
    key = f"pd_{backend}" if kv_cache_dtype == "auto" else f"pd_{backend}_{kv_cache_dtype}"
    cluster = start_cluster(model, flags, backend=backend, one_at_a_time=True)
    try:
        texts = []
        for prompt in prompts:
            response = httpx.post(f"{cluster.router.url}/v1/completions", timeout=120, json={
                "model": model, "prompt": prompt["prompt_token_ids"], "max_tokens": 32,
                "temperature": 0, "ignore_eos": True})
            if response.status_code != 200:
                for instance in cluster.instances:
                    print(f"--- {instance.name} log:\n{instance.log_tail(4000)}", flush=True)
                return {f"{key}_equals_cpu": False,
                        f"{key}_error": f"{response.status_code} {response.text[:1000]}"}
            texts.append(response.json()["choices"][0]["text"])
        expected = [tokenizer.decode(ids) for ids in reference]
        decode = cluster.decodes[0].engine_info()
        rooms = decode["scheduler"]["kv_connector"].get(f"worker_rooms_over_{backend}", 0)
        return {f"{key}_equals_cpu": texts == expected,
                f"{key}_rooms_over_{backend}": rooms,
                f"{key}_every_room_over_{backend}": rooms >= len(prompts),
                f"{key}_decode_integrity": decode["integrity"],
                f"{key}_prefill_integrity": cluster.prefills[0].engine_info()["integrity"]}
    finally:
        cluster.close()


# Tensor parallelism over NCCL, one GPU per rank (issue 18 runs these): every optimisation on
# (CUDA graphs with the all-reduces captured, fused ops and folded norms, the Triton GEMM of
# small batches, async scheduling), then with them off one at a time.
TP_CONFIGS = {
    "default": {},
    "enforce_eager": {"enforce_eager": True},
    "sync_scheduling": {"async_scheduling": False},
    "chunks_of_64": {"max_num_batched_tokens": 64},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "preemption": {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 64,
                   "max_model_len": 256},
}


def tp_configs(num_gpus: int, eagle: str | None) -> dict[str, dict]:
    """TP_CONFIGS at every size up to the GPUs (2, 4, 8), and speculation at TP = 2."""
    configs: dict[str, dict] = {}
    for size in (2, 4, 8):
        if size <= num_gpus:
            configs.update({f"tp{size}_{name}": {"tensor_parallel_size": size, **kwargs}
                            for name, kwargs in TP_CONFIGS.items()})
    if num_gpus >= 2 and eagle is not None:
        configs["tp2_spec_eagle"] = {"tensor_parallel_size": 2, "speculative_config": {
            "method": "eagle", "model": eagle, "num_speculative_tokens": 3, **ALWAYS_DRAFT}}
    return configs


# ~1 ms of an H200's clock
LAG_CYCLES = 2_000_000
# Drafting on whatever the batch size and acceptance (the drafting policy out of the way).
ALWAYS_DRAFT = {"disable_by_batch_size": None, "min_accepted_tokens_per_step": 0}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, **ALWAYS_DRAFT}
# The policy switching drafting on and off with the acceptance (drafts proposed on the device,
# every step overlapped).
NGRAM_SWITCHING = {**NGRAM, "min_accepted_tokens_per_step": 1.0, "probe_interval": 1}


def spec_configs(model: str, eagle: str) -> dict[str, dict]:
    return {
        "spec_ngram": {"speculative_config": NGRAM},
        "spec_ngram_eager": {"speculative_config": NGRAM, "enforce_eager": True},
        "spec_ngram_chunks_of_32": {"speculative_config": NGRAM, "max_num_batched_tokens": 32},
        "spec_ngram_switching_async": {"speculative_config": NGRAM_SWITCHING},
        # Async scheduling (the default on a GPU) proposes n-gram drafts on the device; this
        # is the host's proposer.
        "spec_ngram_sync": {"speculative_config": NGRAM, "async_scheduling": False},
        # Model proposers: their device pass after every step (async scheduling, the
        # default on a GPU), and the host's synchronous path.
        "spec_draft_model_self": {"speculative_config": {
            "method": "draft_model", "model": model, "num_speculative_tokens": 4,
            **ALWAYS_DRAFT}},
        "spec_draft_model_self_eager": {"speculative_config": {
            "method": "draft_model", "model": model, "num_speculative_tokens": 4,
            **ALWAYS_DRAFT}, "enforce_eager": True},
        "spec_draft_model_self_chunks_of_32": {"speculative_config": {
            "method": "draft_model", "model": model, "num_speculative_tokens": 4,
            **ALWAYS_DRAFT}, "max_num_batched_tokens": 32},
        "spec_eagle": {"speculative_config": {
            "method": "eagle", "model": eagle, "num_speculative_tokens": 3, **ALWAYS_DRAFT}},
        # Drafting switched off (for the batch size; for a random head's acceptance, probing
        # every other step): the device passes skipped, then caught up. In 64-token chunks
        # the longest prompt decodes alone at the end. The self-draft accepts every draft
        # only when its KV is right at every position.
        "spec_draft_model_self_switching": {"speculative_config": {
            "method": "draft_model", "model": model, "num_speculative_tokens": 4,
            "disable_by_batch_size": 4, "min_accepted_tokens_per_step": 0},
            "max_num_batched_tokens": 64},
        # A prompt reloaded from the CPU tier into blocks that held other prompts: the
        # self-draft accepts every draft only if the loaded blocks' proposer KV is caught up.
        "spec_draft_model_self_cpu_kv_tier": {"speculative_config": {
            "method": "draft_model", "model": model, "num_speculative_tokens": 4,
            **ALWAYS_DRAFT}, "kv_offloading_size": 0.05, "num_gpu_blocks_override": 96,
            "max_model_len": 1024},
        "spec_eagle_switching": {"speculative_config": {
            "method": "eagle", "model": eagle, "num_speculative_tokens": 3,
            "disable_by_batch_size": None, "min_accepted_tokens_per_step": 1.0,
            "probe_interval": 2}, "max_num_batched_tokens": 64},
        "spec_draft_model_self_sync": {"speculative_config": {
            "method": "draft_model", "model": model, "num_speculative_tokens": 4,
            **ALWAYS_DRAFT}, "async_scheduling": False},
        "spec_eagle_sync": {"speculative_config": {
            "method": "eagle", "model": eagle, "num_speculative_tokens": 3, **ALWAYS_DRAFT},
            "async_scheduling": False},
    }


@contextlib.contextmanager
def lagging_loads():
    """Every CPU-tier load queued behind LAG_CYCLES of device sleep on its stream."""
    load = BlockMover.load

    def lagging_load(self, *args):
        self.load_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.load_stream):
            torch.cuda._sleep(LAG_CYCLES)
        return load(self, *args)

    BlockMover.load = lagging_load
    try:
        yield
    finally:
        BlockMover.load = load


@contextlib.contextmanager
def lagging_graph_replays():
    """Every CUDA graph replay queued behind LAG_CYCLES of device sleep."""
    replay = DecodeGraphs.replay

    def lagging_replay(self, size):
        torch.cuda._sleep(LAG_CYCLES)
        return replay(self, size)

    DecodeGraphs.replay = lagging_replay
    try:
        yield
    finally:
        DecodeGraphs.replay = replay


def counting(fn, calls: list):
    """fn, appending to `calls` at each call."""
    def wrapper(*args):
        calls.append(1)
        return fn(*args)
    return wrapper


def greedy_ids(llm: LLM, prompts: list[dict], max_tokens: int = 32,
               one_at_a_time: bool = False) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if one_at_a_time:  # lone prompts: the prefill CUDA graphs (twice: then over the cache)
        for _ in range(2):
            ids = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                   for p in prompts]
        return ids
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def cpu_greedy_ids(model: str, kv_cache_dtype: str,
                   prompt_sets: list[tuple[list[dict], int]]) -> tuple[list[list[int]], ...]:
    """The CPU engine's (float32) greedy ids over a cache of `kv_cache_dtype`, for each
    (prompts, max_tokens)."""
    cpu = LLM(model=model, dtype="float32", device="cpu", max_num_batched_tokens=64,
              kv_cache_dtype=kv_cache_dtype)
    ids = tuple(greedy_ids(cpu, prompts, max_tokens) for prompts, max_tokens in prompt_sets)
    cpu.shutdown()
    return ids


TRAINED_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain what a CPU does in one sentence."}],
    [{"role": "system", "content": "You are a pirate. Answer like one."},
     {"role": "user", "content": "How are you today?"}],
    [{"role": "user", "content": "Repeat this sentence exactly: the quick brown fox jumps over "
                                 "the lazy dog."}],
    [{"role": "user", "content": "Tell me about the history of the bicycle."}],
    [{"role": "user", "content": "Summarise in one sentence: the library closes for renovation "
                                 "from March to June; books can be returned at the town hall."}],
]


def trained_model_check(gguf_path: str) -> dict[str, object]:
    """The trained SmolLM2 (a .gguf): greedy chat replies (64 tokens, EOS ignored) on the GPU in
    float32 equal the CPU's float32 ones (checked), and in bfloat16 the position of the first
    token that differs from them in each reply (recorded: bfloat16 rounds differently)."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def replies(**kwargs: object) -> list[list[int]]:
        llm = LLM(model=gguf_path, max_model_len=1024, **kwargs)
        out = [list(o.outputs[0].token_ids)
               for o in llm.chat(TRAINED_CONVERSATIONS, params, use_tqdm=False)]
        llm.shutdown()
        return out

    reference = replies(dtype="float32", device="cpu")
    result: dict[str, object] = {"smollm2_float32_equals_cpu": replies(
        dtype="float32", device="cuda") == reference}
    bf16 = replies(dtype="bfloat16", device="cuda")
    first = [next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
             for got, want in zip(bf16, reference)]
    result["smollm2_bfloat16_first_difference_from_cpu_float32"] = first
    result["smollm2_bfloat16_replies_equal_to_cpu_float32"] = sum(f == 64 for f in first)
    return result


def fp8_weights_check(work: str) -> dict[str, object]:
    """FP8 checkpoints (per 16 x 32 block, and per channel) with their FP8 weights kept on the
    GPU (sluice.model.fp8_gemm), in float32, against the CPU's float32 engine on the weights
    dequantized at load. One-token prompts, decoded one request at a time: every product has
    one row and runs weight-only (FP8 weights widened, activations as they are), so greedy
    ids equal the CPU's (checked). Longer prompts quantize their activations to FP8 in the
    prefill (W8A8), which moves the logits by design: the tokens before a first difference
    are recorded, not checked."""
    rng = random.Random(5)
    short = [{"prompt_token_ids": [rng.randrange(3, 600)]} for _ in range(3)]
    long = [{"prompt_token_ids": [rng.randrange(3, 600) for _ in range(n)]} for n in (40, 130)]
    result: dict[str, object] = {}
    for kind in ("block", "channel"):
        model = make_tiny_model(os.path.join(work, f"fp8-{kind}"), quantize=f"fp8-{kind}",
                                block_size=(16, 32))
        cpu = LLM(model=model, dtype="float32", device="cpu")
        want_short = [greedy_ids(cpu, [p])[0] for p in short]
        want_long = greedy_ids(cpu, long)
        cpu.shutdown()
        for name, kwargs in (("default", {}), ("enforce_eager", {"enforce_eager": True})):
            llm = LLM(model=model, dtype="float32", device="cuda", **kwargs)
            runner = llm.llm_engine.engine_core.executor.model_runner
            qkv = runner.model.model.layers[0].self_attn.qkv_proj
            result[f"fp8_weights_{kind}_{name}_layers_hold_fp8"] = qkv.is_fp8
            result[f"fp8_weights_{kind}_{name}_one_row_steps_equals_cpu"] = (
                [greedy_ids(llm, [p])[0] for p in short] == want_short)
            result[f"fp8_weights_{kind}_{name}_w8a8_prefill_tokens_before_a_difference"] = [
                next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
                for got, want in zip(greedy_ids(llm, long), want_long)]
            llm.shutdown()
    return result


def experts_only_fp8_folder(source: str, out: str, choice: str,
                            block: tuple[int, int]) -> str:
    """A copy of float folder `source` whose experts alone are FP8 (quantize_weights on the
    expert tensors; the loader reads the other tensors as they are), so every product but the
    experts' is the CPU's float32 one at any batch."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sluice.model.quantization import quantize_weights

    shutil.copytree(source, out)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    experts = {name: t for name, t in tensors.items() if ".experts." in name}
    quantized, quantization_config = quantize_weights(experts, choice, block)
    save_file({**tensors, **quantized}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return out


def fp8_moe_check(work: str, device: str = "cuda") -> dict[str, object]:
    """Tiny FP8 Qwen3-MoE checkpoints (8 experts of 32, 2 a token; per 16 x 32 block, and per
    channel) with their FP8 experts kept (sluice.model.triton_moe's W8A16 kernels), in float32,
    by default and eager, against the CPU's float32 engine on the weights dequantized at load
    (`--only fp8_moe`). The whole model FP8, one-token prompts decoded alone: every product
    one row (the dense layers weight-only, the experts' 2 pairs the pair kernel), greedy ids
    equal. The experts alone FP8, a batch of prompts: prefill chunks and decode batches of
    more than 16 pairs take the grouped kernel, and greedy ids equal. `device` "cpu" (with
    SLUICE_FP8_WEIGHTS=keep) runs the same path on the CPU's reference op (the tests)."""
    rng = random.Random(6)
    short = [{"prompt_token_ids": [rng.randrange(3, 600)]} for _ in range(3)]
    batch = [{"prompt_token_ids": [rng.randrange(3, 600) for _ in range(n)]}
             for n in (40, 130, 5, 17, 9, 60, 3, 25, 11)]
    float_folder = make_tiny_model(os.path.join(work, "moe-float"), arch="qwen3_moe")
    result: dict[str, object] = {}
    for kind in ("block", "channel"):
        whole = make_tiny_model(os.path.join(work, f"moe-fp8-{kind}"), arch="qwen3_moe",
                                quantize=f"fp8-{kind}", block_size=(16, 32))
        experts = experts_only_fp8_folder(float_folder, os.path.join(work, f"moe-exp-{kind}"),
                                          f"fp8-{kind}", (16, 32))
        want: dict[str, list[list[int]]] = {}
        for folder, prompts, one in ((whole, short, True), (experts, batch, False)):
            with _fp8_weights("dequantize"):
                cpu = LLM(model=folder, dtype="float32", device="cpu")
                want[folder] = greedy_ids(cpu, prompts, one_at_a_time=one)
                cpu.shutdown()
        for name, kwargs in (("default", {}), ("enforce_eager", {"enforce_eager": True})):
            for folder, prompts, one, what in (
                    (whole, short, True, "one_row_steps"), (experts, batch, False, "batch")):
                llm = LLM(model=folder, dtype="float32", device=device, **kwargs)
                runner = llm.llm_engine.engine_core.executor.model_runner
                moe = runner.model.model.layers[0].mlp
                key = f"fp8_moe_{kind}_{name}_{what}"
                result[f"{key}_experts_hold_fp8"] = moe.is_fp8
                result[f"{key}_equals_cpu"] = (
                    greedy_ids(llm, prompts, one_at_a_time=one) == want[folder])
                llm.shutdown()
    return result


@contextlib.contextmanager
def _fp8_weights(choice: str):  # noqa: ANN202
    """SLUICE_FP8_WEIGHTS=choice around the block (the CPU reference dequantizes at load)."""
    previous = os.environ.get("SLUICE_FP8_WEIGHTS")
    os.environ["SLUICE_FP8_WEIGHTS"] = choice
    try:
        yield
    finally:
        if previous is None:
            del os.environ["SLUICE_FP8_WEIGHTS"]
        else:
            os.environ["SLUICE_FP8_WEIGHTS"] = previous


# Architectures beyond the three make_tiny_model writes: tiny random transformers models. The
# windows (24 positions) are shorter than most prompts, so the windowed kernels, the decode
# graphs over them and the blocks freed behind an all-windowed model's window all run.
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None, "eos_token_id": None}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "pad_token_id": None, "eos_token_id": None, "sliding_window": 24,
        "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # Qwen3-30B-A3B's routing (8 of 128 experts): the one-launch routing and the alignment
    # kernel (4 requests decode 32 pairs: grouped); the 8-expert model's 8 pairs take the pair
    # kernel
    "qwen3_moe_128": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "mlp_only_layers": []}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 6, "num_experts_per_tok": 2, "pad_token_id": None,
        "eos_token_id": None}),
}


def families_check(work: str) -> dict[str, object]:
    """Mistral, Phi-3 (fused q/k/v and gate/up), Gemma 3, Qwen3-MoE, Qwen2-MoE and Mixtral (the
    fused expert kernels of sluice.model.triton_moe in the CUDA graphs) in float32 on the GPU,
    by default and eager, and the MoE models at TP 2 with expert parallelism where there are
    two GPUs, against the CPU's float32 engine: greedy ids equal (`--only families`)."""
    import transformers

    from sluice.model.tiny import build_tokenizer

    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 600) for _ in range(n)]}
               for n in (5, 40, 130, 17)]
    result: dict[str, object] = {}
    for arch, (config_name, model_name, extra) in FAMILIES.items():
        folder = os.path.join(work, f"family-{arch}")
        tokenizer = build_tokenizer(folder)
        config = getattr(transformers, config_name)(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
            **extra)
        torch.manual_seed(0)
        getattr(transformers, model_name)(config).save_pretrained(folder)
        cpu = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512)
        reference = greedy_ids(cpu, prompts)
        cpu.shutdown()
        runs = [("default", {}), ("enforce_eager", {"enforce_eager": True})]
        if "_moe" in arch or arch == "mixtral":
            if torch.cuda.device_count() >= 2:  # expert parallelism: two GPUs, else skipped
                runs.append(("tp2_ep", {"tensor_parallel_size": 2,
                                        "enable_expert_parallel": True}))
            else:
                result[f"{arch}_tp2_ep_equals_cpu"] = "skipped: fewer than 2 GPUs"
        for name, kwargs in runs:
            llm = LLM(model=folder, dtype="float32", device="cuda", max_model_len=512, **kwargs)
            result[f"{arch}_{name}_equals_cpu"] = greedy_ids(llm, prompts) == reference
            llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default="benchmarks/results/gpu-check")
    parser.add_argument("--only", default="", help="comma-separated setting-name prefixes")
    parser.add_argument("--trained-gguf", default=None,
                        help="SmolLM2-135M-Instruct's .gguf: also check the trained model "
                             "(float32 against the CPU, bfloat16's first differences)")
    ns = parser.parse_args()
    out_dir = ns.out_dir
    only = tuple(p for p in ns.only.split(",") if p)
    work = tempfile.mkdtemp()
    result: dict[str, object] = {}  # check name -> true / false / a figure
    if ns.trained_gguf:
        result.update(trained_model_check(ns.trained_gguf))
    rng = random.Random(0)
    pd = None
    stack = contextlib.ExitStack()
    pools = pool_configs(stack) if wants_pools(only) else {}
    if not only or any("fp8_weights".startswith(p) or p.startswith("fp8_weights")
                       for p in only):
        result.update(fp8_weights_check(work))
    if not only or any(p.startswith("fp8_moe") or "fp8_moe".startswith(p) for p in only):
        result.update(fp8_moe_check(work))
    if not only or any(p.startswith("families") or "families".startswith(p) for p in only):
        result.update(families_check(work))
    for arch in ("qwen3", "llama", "qwen2"):
        model = make_tiny_model(os.path.join(work, arch), arch=arch)
        prompts = [{"prompt_token_ids": [rng.randrange(3, 600) for _ in range(n)]}
                   for n in (5, 40, 130, 17)]
        cpu = LLM(model=model, dtype="float32", device="cpu", max_num_batched_tokens=64)
        reference = greedy_ids(cpu, prompts)
        # Decode steps from 480 keys to past 512: the decode graphs captured for short
        # contexts, then the main set (sluice.worker.graph_runner.SHORT_CONTEXT_TOKENS).
        long_rng = random.Random(1)
        long_prompts = [{"prompt_token_ids": [long_rng.randrange(3, 600) for _ in range(480)]}
                        for _ in range(2)]
        long_reference = greedy_ids(cpu, long_prompts, max_tokens=64)
        # Decode batches of 16 and more requests: q/k norm, RoPE and the KV store inside the
        # decode attention kernel (TritonBackend.decode_from_qkv).
        many_rng = random.Random(2)
        many_prompts = [{"prompt_token_ids": [many_rng.randrange(3, 600)
                                              for _ in range(many_rng.randrange(3, 60))]}
                        for _ in range(24)]
        many_reference = greedy_ids(cpu, many_prompts)
        cpu.shutdown()
        # The CPU engine's greedy ids per 8-bit cache dtype, made when a setting first needs
        # them: (prompts, the 24 prompts, the long prompts).
        fp8_references: dict[str, tuple[list[list[int]], ...]] = {}
        configs = {**CONFIGS, **pools}
        if arch == "qwen3" and ("pd" in only or "pd_shm" in only):
            pd = (model, prompts, reference)
        eagle = None
        if arch != "qwen2":
            eagle = make_tiny_eagle(model, os.path.join(work, arch + "-eagle"))
            configs.update(spec_configs(model, eagle))
        if torch.cuda.device_count() >= 2:
            configs.update(tp_configs(torch.cuda.device_count(), eagle))
        for name, kwargs in configs.items():
            if only and not name.startswith(only):
                continue
            fused_calls = []
            if name == "default":  # the decode graphs' captures call it where the rule says
                real_fused = triton_backend.decode_from_qkv
                triton_backend.decode_from_qkv = counting(real_fused, fused_calls)
            try:
                llm = LLM(model=model, dtype="float32", device="cuda", **kwargs)
            finally:
                if name == "default":
                    triton_backend.decode_from_qkv = real_fused
            lagging = name.endswith("_device_lagging")
            if lagging:
                with lagging_graph_replays():
                    result[f"{arch}_{name}_equals_cpu"] = greedy_ids(llm, prompts) == reference
            elif name.startswith("fp8"):
                kv_cache_dtype = kwargs["kv_cache_dtype"]
                if kv_cache_dtype not in fp8_references:
                    fp8_references[kv_cache_dtype] = cpu_greedy_ids(
                        model, kv_cache_dtype, [(prompts, 32), (many_prompts, 32),
                                                (long_prompts, 64)])
                references = fp8_references[kv_cache_dtype]
                result[f"{arch}_{name}_equals_cpu"] = greedy_ids(llm, prompts) == references[0]
                if name in ("fp8_kv", "fp8_e5m2_kv"):
                    result[f"{arch}_{name}_24_prompts_equals_cpu"] = (
                        greedy_ids(llm, many_prompts) == references[1])
                    # Recorded, not checked: rounding to 8 bits turns a last-bit difference
                    # between the GPU's and the CPU's float32 K/V into a whole 8-bit step
                    # where a value lies at a rounding boundary, and over two 480-token
                    # prompts that happens now and then (Llama's, one H100 run).
                    result[f"{arch}_{name}_across_512_keys_tokens_before_a_difference"] = [
                        next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
                        for got, want in zip(greedy_ids(llm, long_prompts, max_tokens=64),
                                             references[2])]
            else:
                result[f"{arch}_{name}_equals_cpu"] = greedy_ids(llm, prompts) == reference
            stats = llm.get_spec_decoding_stats()
            if stats is not None:
                result[f"{arch}_{name}_accepted_of_drafted"] = (
                    f"{stats.num_accepted_tokens}/{stats.num_draft_tokens}")
                num_steps = (stats.num_steps_drafting + stats.num_steps_off_batch_size
                             + stats.num_steps_off_acceptance)
                result[f"{arch}_{name}_steps_drafting_of_counted"] = (
                    f"{stats.num_steps_drafting}/{num_steps}")
            if name.startswith(("cpu_kv_tier", "fp8_kv_cpu_kv_tier")):
                # Again, from the CPU tier: every full block of every prompt loads.
                assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
                want = fp8_references["fp8"][0] if name.startswith("fp8") else reference
                with lagging_graph_replays() if lagging else contextlib.nullcontext(), \
                        lagging_loads() if lagging else contextlib.nullcontext():
                    result[f"{arch}_{name}_loaded_equals_cpu"] = greedy_ids(llm, prompts) == want
                stats = llm.llm_engine.scheduler.connector.get_stats()
                result[f"{arch}_{name}_loaded_blocks"] = stats["loaded_blocks"]
                result[f"{arch}_{name}_loaded_some"] = stats["loaded_blocks"] > 0
            if name == "spec_draft_model_self_cpu_kv_tier":
                manager = llm.llm_engine.kv_cache_manager
                for _ in range(2):  # other prompts' KV over every GPU block
                    assert manager.reset_prefix_cache()
                    greedy_ids(llm, long_prompts, max_tokens=8)
                assert manager.reset_prefix_cache()
                before = llm.get_spec_decoding_stats()
                result[f"{arch}_{name}_loaded_equals_cpu"] = (
                    greedy_ids(llm, prompts) == reference)
                after = llm.get_spec_decoding_stats()
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                result[f"{arch}_{name}_loaded_accepted_of_drafted"] = f"{accepted}/{drafted}"
                result[f"{arch}_{name}_loaded_accepted_all"] = drafted > 0 and accepted == drafted
                loaded = llm.llm_engine.scheduler.connector.get_stats()["loaded_blocks"]
                result[f"{arch}_{name}_loaded_some"] = loaded > 0
            if name.startswith(("pool_", "fp8_kv_pool_")):
                # Again, from the pool: every full block of every prompt loads.
                worker = llm.llm_engine.engine_core.executor.worker.connector
                assert worker.wait_for_pending_saves(120.0)
                assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
                want = fp8_references["fp8"][0] if name.startswith("fp8") else reference
                result[f"{arch}_{name}_loaded_equals_cpu"] = greedy_ids(llm, prompts) == want
                stats = llm.llm_engine.scheduler.connector.get_stats()
                result[f"{arch}_{name}_hit_blocks"] = stats.get("pool_hit_blocks", 0)
                result[f"{arch}_{name}_loaded_some"] = stats.get("pool_hit_blocks", 0) > 0
            if name in ("default", "chunks_of_64"):
                graphs = llm.llm_engine.engine_core.executor.model_runner.graph_runner
                replays = graphs.mixed_graphs.num_replays if graphs.mixed_graphs else 0
                result[f"{arch}_{name}_replayed_mixed_step_graphs"] = replays > 0
            if name == "default":
                # Steps of more tokens than this ran with the layers' norms folded (prompt
                # steps here); None: not folded (Qwen2's q/k/v bias).
                runner = llm.llm_engine.engine_core.executor.model_runner
                result[f"{arch}_folded_norms_above_tokens"] = (
                    runner.model.model.folded_above_tokens)
                result[f"{arch}_one_prompt_at_a_time_equals_cpu"] = greedy_ids(
                    llm, prompts, one_at_a_time=True) == reference
                result[f"{arch}_24_prompts_equals_cpu"] = (
                    greedy_ids(llm, many_prompts) == many_reference)
                # Qwen2 keeps its norms (a q/k/v bias), so its layers never ask.
                result[f"{arch}_fused_decode_captured"] = (
                    len(fused_calls) > 0 if arch != "qwen2" else None)
                graphs = runner.graph_runner
                short_before = graphs.short_graphs.num_replays if graphs.short_graphs else 0
                main_before = graphs.graphs.num_replays
                # Six requests (the two prompts three times): the tiny models' 2 KV heads then
                # make 12 programs, too many for one request's short-context split, so the
                # short graphs run the unified kernel and the main set 8 splits (two requests
                # get 8 splits in both: no short graphs for them).
                result[f"{arch}_across_512_keys_equals_cpu"] = greedy_ids(
                    llm, long_prompts * 3, max_tokens=64) == long_reference * 3
                result[f"{arch}_across_512_keys_replayed_short_then_main_decode_graphs"] = (
                    graphs.short_graphs is not None
                    and graphs.short_graphs.num_replays > short_before
                    and graphs.graphs.num_replays > main_before)
            llm.shutdown()
    stack.close()
    if pd is not None:
        from sluice.testing.servers import mooncake_missing

        # CUDA IPC: the same check over the shm backend.
        result.update(pd_equals_cpu(*pd, backend="shm"))
        if "pd" in only and mooncake_missing() is None:
            result.update(pd_equals_cpu(*pd))
            model, prompts, _ = pd
            fp8_reference = cpu_greedy_ids(model, "fp8", [(prompts, 32)])[0]
            result.update(pd_equals_cpu(model, prompts, fp8_reference, "fp8"))
    record = make_record("gpu-check", result, device="cuda:0",
                         command=["python", "scripts/gpu_check.py", *sys.argv[1:]])
    print(json.dumps(record, indent=1), flush=True)
    write_record(os.path.join(out_dir, "gpu_check.json"), record)
    failed = [k for k, v in result.items() if v is False]
    if failed:
        sys.exit(f"greedy ids differ from the CPU reference: {failed}")


if __name__ == "__main__":
    main()
