"""Micro-benchmark of the Triton attention kernels on one CUDA GPU, against ceilings measured in
the same run.

- copy: device-to-device copy bandwidth of a 1 GiB tensor (bytes read + written per second), the
  practical ceiling of a memory-bound kernel;
- decode: one attention step (store + attention) of a decode batch, timed as CUDA graph replays
  with the L2 flushed before each; achieved bytes/s = (K/V context read + Q read + O write) per
  second, and its fraction of the copy bandwidth (target >= 0.7 at batch 256 x context 1k); the
  few-long-sequence cases (batch 1 and 8 at 8k) run both the split-KV path and the unified kernel;
- prefill: one fresh causal prompt of 1k and 8k tokens, TFLOP/s (2 * S^2 * H * D for the causal
  half of QK^T and PV), next to torch's scaled_dot_product_attention on the same shapes;
- fused decode (`--fused-cases`, default 64 requests x 192 keys): a decode layer's attention work
  from its raw q/k/v projection (the input norm folded, as the CUDA path runs it), in the one
  launch that batches of 16 to 4 x SMs / KV heads requests take
  (sluice.attention.triton.decode_qkv) against the two it replaces (qk_norm_rope with the KV
  store, then the decode kernel), with the largest difference between their outputs.

Shapes are Qwen3-0.6B's attention: 16 query heads, 8 KV heads, head_dim 128, bf16, block size 16.
`--sweep` also times a grid of tile shapes for each kernel. `--kv-cache-dtype fp8` (or
fp8_e5m2) puts the decode, ragged and fused cases' caches in 8 bits (bytes/s then counts one
byte a cached value); the prefill and mixed cases stay 16-bit.

    python -m sluice.bench.kernels --output kernels.json [--sweep] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import triton

from sluice.attention.dense import dense_causal_attention
from sluice.attention.kv_layout import KV_CACHE_DTYPES, resolve_kv_cache_dtype, to_cache_dtype
from sluice.attention.metadata import AttentionMetadata
from sluice.attention.torch_ref import TorchRefBackend
from sluice.attention.triton import TileConfig
from sluice.attention.triton.decode_qkv import decode_from_qkv
from sluice.attention.triton_backend import (
    TritonBackend,
    TritonBackendConfig,
    choose_num_splits,
)
from sluice.bench.record import make_record, write_record
from sluice.model.layers import RotaryEmbedding
from sluice.model.triton_ops import qk_norm_rope

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
HIDDEN_SIZE, RMS_EPS, ROPE_THETA = 1024, 1e-6, 1e6  # Qwen3-0.6B's
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
DECODE_CASES = [(256, 1024), (1, 8192), (8, 8192), (32, 2048)]  # (batch, context)
MIXED_CASE = (255, 1024, 2048)  # decodes, their context, one fresh prefill chunk
PREFILL_LENS = [1024, 8192]
DECODE_SWEEP = [
    TileConfig(16, n, w, s)
    for n, w, s in [
        (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (64, 2, 3),
        (64, 4, 5), (128, 4, 3), (128, 4, 4), (128, 8, 3),
    ]
]  # fmt: skip
PREFILL_SWEEP = [
    TileConfig(128, 64, 8, 3),
    TileConfig(128, 64, 8, 4),
    TileConfig(128, 128, 8, 2),
    TileConfig(128, 128, 8, 3),
    TileConfig(128, 128, 8, 4),
    TileConfig(64, 64, 4, 2),
    TileConfig(64, 64, 4, 3),
    TileConfig(64, 64, 4, 4),
    TileConfig(64, 128, 4, 2),
    TileConfig(64, 128, 4, 3),
    TileConfig(64, 128, 8, 3),
    TileConfig(32, 64, 4, 3),
    TileConfig(32, 128, 4, 3),
    TileConfig(256, 64, 8, 3),
]
RAGGED_SWEEP = [TileConfig(16, n, w, s) for n, w, s in [(64, 2, 2), (64, 4, 5), (128, 4, 2),
                                                        (128, 8, 2), (256, 8, 2)]]
SPLIT_SWEEP = [
    TileConfig(16, n, w, s)
    for n, w, s in [(32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 4, 5),
                    (128, 4, 3)]
]


class GraphTimer:
    """Seconds per call of `fn`, as the median of CUDA graph replays each preceded by an L2
    flush, so small working sets are read from HBM as in a real step."""

    def __init__(self, device: torch.device, iters: int) -> None:
        self.iters = iters
        self.flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)  # > L2 (60 MB)

    def __call__(self, fn: Callable[[], object]) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and warm up outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.iters)
        ]
        graph.replay()
        for start, end in events:
            self.flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def copy_bandwidth(device: torch.device, iters: int) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * iters / (start.elapsed_time(end) / 1e3)


def make_step(
    seq_lens: list[int], query_lens: list[int], device: torch.device, seed: int = 0,
    shuffle: bool = True, cache_dtype: torch.dtype = DTYPE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q/k/v, a cache of `cache_dtype` whose blocks are shuffled over the whole pool (a
    served cache; with shuffle=False each request's blocks are consecutive, as an offline run's
    first requests get them), and the metadata of one step."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    perm = (torch.randperm(num_blocks, generator=gen, device=device) if shuffle
            else torch.arange(num_blocks, device=device)).to(torch.int32)
    width = max(blocks_per_req)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    slots, first = [], 0
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        table = perm[first : first + blocks_per_req[i]]
        first += blocks_per_req[i]
        block_tables[i, : len(table)] = table
        pos = torch.arange(seq_len - query_len, seq_len, device=device)
        slots.append(table[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    num_tokens = sum(query_lens)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_tables=block_tables,
        slot_mapping=torch.cat(slots),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens_cpu,
    )

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=DTYPE)

    kv_cache = to_cache_dtype(randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                              cache_dtype)
    query = randn(num_tokens, NUM_HEADS, HEAD_DIM)
    key, value = (
        randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
    )
    return query, key, value, kv_cache, metadata


def decode_bytes(contexts: list[int], kv_cache: torch.Tensor) -> int:
    """Bytes a decode step of these contexts moves: its K/V read in the cache's dtype, its
    queries read and outputs written in the model's."""
    kv = 2 * sum(contexts) * NUM_KV_HEADS * HEAD_DIM * kv_cache.element_size()
    return kv + 2 * len(contexts) * NUM_HEADS * HEAD_DIM * DTYPE.itemsize


def run_decode(
    timer: GraphTimer,
    copy_bps: float,
    batch: int,
    context: int,
    configs: dict[str, TritonBackendConfig],
    cache_dtype: torch.dtype = DTYPE,
) -> dict[str, Any]:
    device = timer.flush.device
    step = make_step([context] * batch, [1] * batch, device, cache_dtype=cache_dtype)
    query, key, value, kv_cache, metadata = step
    bytes_moved = decode_bytes([context] * batch, kv_cache)
    expected = TorchRefBackend().forward(query, key, value, kv_cache, metadata, SCALE)
    results = {}
    for label, config in configs.items():
        backend = TritonBackend(config)
        try:
            seconds = timer(lambda b=backend: b.forward(*step, SCALE))
        except triton.runtime.errors.OutOfResources as e:  # a sweep shape too big for the SM
            results[label] = {"config": _describe(config), "error": str(e)}
            continue
        out = backend.forward(query, key, value, kv_cache, metadata, SCALE)
        results[label] = {
            "config": _describe(config),
            "us": seconds * 1e6,
            "bytes_per_s": bytes_moved / seconds,
            "fraction_of_copy": bytes_moved / seconds / copy_bps,
            "max_abs_diff_vs_torch_ref": (out.float() - expected.float()).abs().max().item(),
        }
    return {"batch": batch, "context": context, "bytes": bytes_moved, "runs": results}


def workload_contexts(step: int) -> list[int]:
    """Context lengths of the nano-vllm workload's decode batch at engine step `step` (prompt
    plus tokens so far, for the requests still running), in the engine's batch order."""
    from sluice.bench.workloads import nano_vllm_workload

    workload = nano_vllm_workload()
    return [len(p) + step for p, m in zip(workload.prompts, workload.max_tokens) if m > step]


def run_ragged(timer: GraphTimer, copy_bps: float, step: int,
               configs: dict[str, TritonBackendConfig], shuffle: bool = True,
               cache_dtype: torch.dtype = DTYPE) -> dict[str, Any]:
    """A decode batch of the real workload's ragged contexts (see workload_contexts)."""
    device = timer.flush.device
    contexts = workload_contexts(step)
    step_inputs = make_step(contexts, [1] * len(contexts), device, shuffle=shuffle,
                            cache_dtype=cache_dtype)
    query, key, value, kv_cache, metadata = step_inputs
    batch = len(contexts)
    bytes_moved = decode_bytes(contexts, kv_cache)

    def timed(config: TritonBackendConfig, inputs: tuple, num_bytes: int) -> dict[str, Any]:
        backend = TritonBackend(config)
        seconds = timer(lambda: backend.forward(*inputs, SCALE))
        return {"config": _describe(config), "us": seconds * 1e6,
                "bytes_per_s": num_bytes / seconds,
                "fraction_of_copy": num_bytes / seconds / copy_bps}

    results = {label: timed(config, step_inputs, bytes_moved) for label, config in configs.items()}
    # Longest context first, as the model runner orders a decode batch (decode_order).
    order = torch.argsort(metadata.seq_lens, descending=True, stable=True).to(torch.int32)
    ordered = (query, key, value, kv_cache, dataclasses.replace(metadata, decode_order=order))
    results["unified_longest_first"] = timed(TritonBackendConfig(split_kv="never"), ordered,
                                             bytes_moved)
    # The same number of requests, uniform at the mean context: what raggedness alone costs.
    mean = round(sum(contexts) / batch)
    uniform = make_step([mean] * batch, [1] * batch, device, shuffle=shuffle,
                        cache_dtype=cache_dtype)
    uniform_bytes = decode_bytes([mean] * batch, uniform[3])
    results["unified_uniform_mean_context"] = timed(TritonBackendConfig(split_kv="never"),
                                                    uniform, uniform_bytes)
    return {"step": step, "batch": batch, "mean_context": sum(contexts) / batch,
            "max_context": max(contexts), "bytes": bytes_moved, "runs": results}


def run_prefill(
    timer: GraphTimer, prompt_len: int, configs: dict[str, TritonBackendConfig]
) -> dict[str, Any]:
    device = timer.flush.device
    step = make_step([prompt_len], [prompt_len], device)
    query, key, value, kv_cache, metadata = step
    flops = 2 * prompt_len * prompt_len * NUM_HEADS * HEAD_DIM  # causal half of 4 S^2 H D
    # [1, H, S, D], K/V heads repeated beforehand so torch picks its flash-attention kernel.
    group = NUM_HEADS // NUM_KV_HEADS
    q = query.transpose(0, 1).unsqueeze(0)
    k, v = (t.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0) for t in (key, value))

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    seconds = timer(sdpa)
    expected = sdpa()[0].transpose(0, 1).float()  # [S, H, D]
    sdpa_run = {"us": seconds * 1e6, "tflops": flops / seconds / 1e12}
    results: dict[str, Any] = {"torch_sdpa": sdpa_run}
    # What a step of one fresh prompt runs where cuDNN attention works (dense_prefill).
    seconds = timer(lambda: dense_causal_attention(query, key, value, SCALE))
    out = dense_causal_attention(query, key, value, SCALE)
    results["dense_prefill"] = {"us": seconds * 1e6, "tflops": flops / seconds / 1e12,
                                "max_abs_diff_vs_sdpa": (out.float() - expected).abs().max().item()}
    for label, config in configs.items():
        backend = TritonBackend(config)
        try:
            seconds = timer(lambda b=backend: b.forward(*step, SCALE))
        except triton.runtime.errors.OutOfResources as e:
            results[label] = {"config": _describe(config), "error": str(e)}
            continue
        out = backend.forward(query, key, value, kv_cache, metadata, SCALE)
        results[label] = {
            "config": _describe(config),
            "us": seconds * 1e6,
            "tflops": flops / seconds / 1e12,
            "max_abs_diff_vs_sdpa": (out.float() - expected).abs().max().item(),
        }
    return {"prompt_len": prompt_len, "flops": flops, "runs": results}


@dataclasses.dataclass
class FusedStep:
    """A decode layer's attention inputs from its q/k/v projection (see run_fused)."""

    qkv: torch.Tensor  # [T, (H + 2 * KVH) * D]: the projection of the raw residual rows
    residual: torch.Tensor  # [T, hidden]
    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor  # [max_pos, D] float32
    q_norm_weight: torch.Tensor  # [D]
    k_norm_weight: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata

    def fused(self, tiles: TileConfig) -> torch.Tensor:
        """One launch: norm, RoPE, KV store and attention (reads qkv, writes the cache)."""
        return decode_from_qkv(self.qkv, self.positions, self.cos_sin_cache,
                               self.q_norm_weight, self.k_norm_weight, RMS_EPS, self.residual,
                               RMS_EPS, NUM_HEADS, self.kv_cache, self.metadata, SCALE, tiles)

    def two_launches(self, backend: TritonBackend, qkv: torch.Tensor) -> torch.Tensor:
        """qk_norm_rope storing k and v, then the backend's decode attention. Rewrites `qkv`'s
        q, k and v columns in place, as the model's layers do (a timed loop re-rotates them,
        which changes no kernel's work)."""
        q, k = qk_norm_rope(qkv, self.positions, self.cos_sin_cache, self.q_norm_weight,
                            self.k_norm_weight, RMS_EPS, NUM_HEADS, NUM_KV_HEADS, self.kv_cache,
                            self.metadata.slot_mapping, self.residual, RMS_EPS)
        num_tokens, kv_size = qkv.shape[0], NUM_KV_HEADS * HEAD_DIM
        v = qkv[:, NUM_HEADS * HEAD_DIM + kv_size:]
        return backend.forward(
            q.view(num_tokens, NUM_HEADS, HEAD_DIM), k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
            v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM), self.kv_cache, self.metadata, SCALE,
            kv_stored=True).view(num_tokens, NUM_HEADS * HEAD_DIM)


def make_fused_step(batch: int, context: int, device: torch.device,
                    cache_dtype: torch.dtype = DTYPE) -> FusedStep:
    """Random projection rows, residual rows and head-norm weights, a cache of `cache_dtype`
    and the metadata of a decode step of `batch` requests of `context` keys (the new one
    included)."""
    _, _, _, kv_cache, metadata = make_step([context] * batch, [1] * batch, device,
                                            cache_dtype=cache_dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(batch, width, generator=gen, device=device, dtype=DTYPE)
    residual = torch.randn(batch, HIDDEN_SIZE, generator=gen, device=device, dtype=DTYPE)
    weights = 0.5 + torch.rand(2, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    rope = RotaryEmbedding(HEAD_DIM, context + 1, ROPE_THETA)
    return FusedStep(qkv, residual, metadata.seq_lens.long() - 1,
                     rope.cos_sin_cache.to(device), weights[0], weights[1], kv_cache, metadata)


def run_fused(timer: GraphTimer, copy_bps: float, batch: int, context: int,
              tiles: dict[str, TileConfig], cache_dtype: torch.dtype = DTYPE) -> dict[str, Any]:
    """A decode layer's attention from its projection: the one launch with each of `tiles`,
    and the two launches it replaces with the backend's rules (`two_launches`); each with the
    largest difference from the two launches' output on the same inputs."""
    device = timer.flush.device
    step = make_fused_step(batch, context, device, cache_dtype)
    bytes_moved = decode_bytes([context] * batch, step.kv_cache)
    backend = TritonBackend()
    expected = step.two_launches(backend, step.qkv.clone()).float()
    work = step.qkv.clone()
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "two_launches": lambda: step.two_launches(backend, work)}
    for label, config in tiles.items():
        runs[label] = lambda c=config: step.fused(c)
    results = {}
    for label, fn in runs.items():
        try:
            seconds = timer(fn)
        except triton.runtime.errors.OutOfResources as e:
            results[label] = {"error": str(e)}
            continue
        out = (step.two_launches(backend, step.qkv.clone()) if label == "two_launches"
               else fn())
        results[label] = {"us": seconds * 1e6, "bytes_per_s": bytes_moved / seconds,
                          "fraction_of_copy": bytes_moved / seconds / copy_bps,
                          "max_abs_diff_vs_two_launches": (out.float() - expected).abs().max()
                          .item()}
    return {"batch": batch, "context": context, "bytes": bytes_moved, "runs": results}


def run_mixed(timer: GraphTimer, decodes: int, context: int, chunk: int) -> dict[str, Any]:
    """A chunked-prefill step (decodes plus one prompt chunk), in two launches (the default) and
    in one (decode rows in prefill tiles), against the same work as two separate steps."""
    device = timer.flush.device
    mixed = make_step([context] * decodes + [chunk], [1] * decodes + [chunk], device)
    runs = {
        "mixed": (TritonBackend(), mixed),
        "mixed_one_launch": (TritonBackend(TritonBackendConfig(split_mixed_batches=False)), mixed),
        "decodes_only": (TritonBackend(), make_step([context] * decodes, [1] * decodes, device)),
        "prefill_only": (TritonBackend(), make_step([chunk], [chunk], device)),
    }
    record: dict[str, Any] = {"decodes": decodes, "context": context, "chunk": chunk}
    for label, (backend, step) in runs.items():
        seconds = timer(lambda b=backend, step=step: b.forward(*step, SCALE))
        record[f"{label}_us"] = seconds * 1e6
    record["mixed_over_separate"] = record["mixed_us"] / (
        record["decodes_only_us"] + record["prefill_only_us"]
    )
    return record


def _sweep_name(tiles: TileConfig) -> str:
    return f"{tiles.block_m}m_{tiles.block_n}n_{tiles.num_warps}w_{tiles.num_stages}s"


def _describe(config: TritonBackendConfig) -> dict[str, Any]:
    return asdict(config)


def _unified_tiles(tiles: TileConfig) -> TritonBackendConfig:
    """The unified kernel with `tiles` for every decode batch, whatever the cache dtype."""
    return TritonBackendConfig(split_kv="never", decode_tiles=tiles, short_decode_tiles=tiles,
                               fp8_decode_tiles=tiles)


def _split_tiles(tiles: TileConfig, num_splits: int) -> TritonBackendConfig:
    """The split-KV path with `tiles` and `num_splits`, whatever the cache dtype."""
    return TritonBackendConfig(split_kv="always", split_tiles=tiles, fp8_split_tiles=tiles,
                               num_splits=num_splits)


def _cases(text: str) -> list[tuple[int, int]]:
    """'BATCHxCONTEXT,...' as (batch, context) pairs."""
    cases = []
    for case in filter(None, (c.strip() for c in text.split(","))):
        batch, _, context = case.partition("x")
        if not (batch.isdigit() and context.isdigit() and int(batch) > 0 and int(context) > 0):
            raise ValueError(f"a case must be BATCHxCONTEXT of positive integers, got {case!r}")
        cases.append((int(batch), int(context)))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output", required=True, help="path of the JSON report")
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions per case")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile shapes")
    parser.add_argument("--decode-cases",
                        default=",".join(f"{b}x{c}" for b, c in DECODE_CASES),
                        help="decode batches as BATCHxCONTEXT, comma-separated ('' for none)")
    parser.add_argument("--prefill-lens", default=",".join(map(str, PREFILL_LENS)),
                        help="prompt lengths of the prefill cases, comma-separated ('' for none)")
    parser.add_argument("--captured-max-len", type=int, default=40960,
                        help="decode cases also run with the split count a CUDA graph captured "
                             "for this max_model_len uses (the model's decode graphs do)")
    parser.add_argument("--ragged-steps", default="20,600,900",
                        help="decode batches of the nano-vllm workload at these engine steps "
                             "(ragged contexts); empty: none")
    parser.add_argument("--only-ragged", action="store_true", help="skip the other cases")
    parser.add_argument("--consecutive-blocks", action="store_true",
                        help="ragged batches: each request's blocks consecutive, not shuffled")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="the decode, ragged and fused cases' cache (auto: bf16)")
    parser.add_argument("--fused-cases", default="64x192",
                        help="fused decode batches as BATCHxCONTEXT, comma-separated ('' for "
                             "none)")
    ns = parser.parse_args(argv)
    if ns.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {ns.iters}")
    decode_cases, fused_cases = _cases(ns.decode_cases), _cases(ns.fused_cases)
    cache_dtype = resolve_kv_cache_dtype(ns.kv_cache_dtype, DTYPE)
    if not torch.cuda.is_available():
        print("sluice.bench.kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    command = ["python", "-m", "sluice.bench.kernels", *(sys.argv[1:] if argv is None else argv)]
    print(f"command: {shlex.join(command)}")
    print(f"gpu: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    timer = GraphTimer(device, ns.iters)
    copy_bps = copy_bandwidth(device, ns.iters)
    print(f"copy bandwidth: {copy_bps / 1e12:.2f} TB/s (read + write)")
    report: dict[str, Any] = {
        "num_sms": props.multi_processor_count,
        "copy_bytes_per_s": copy_bps,
        "kv_cache_dtype": str(cache_dtype).removeprefix("torch."),
        "decode": [],
        "prefill": [],
    }
    # Rewritten after every case, so a cut-short run still leaves its numbers.
    record = make_record("kernels", report, device=device, command=command)

    report["ragged_decode"] = []
    for step in [int(x) for x in ns.ragged_steps.split(",") if x.strip()]:
        batch = len(workload_contexts(step))
        configs = {"auto": TritonBackendConfig(), "unified": TritonBackendConfig(split_kv="never")}
        for n in (2, 4, 8):
            configs[f"split_{n}"] = TritonBackendConfig(split_kv="always", num_splits=n)
        if ns.sweep:
            for tiles in DECODE_SWEEP + RAGGED_SWEEP:
                configs[_sweep_name(tiles)] = _unified_tiles(tiles)
        record = run_ragged(timer, copy_bps, step, configs, shuffle=not ns.consecutive_blocks,
                            cache_dtype=cache_dtype)
        report["ragged_decode"].append(record)
        write_record(ns.output, record)
        for label, run in record["runs"].items():
            print(f"ragged decode step {step:4d} batch {batch:3d} (mean ctx "
                  f"{record['mean_context']:.0f}, max {record['max_context']}) {label:22s} "
                  f"{run['us']:9.1f} us {run['bytes_per_s'] / 1e12:5.2f} TB/s  "
                  f"{run['fraction_of_copy']:5.1%} of copy")
    if ns.only_ragged:
        return 0

    for batch, context in decode_cases:
        configs = {"auto": TritonBackendConfig(), "unified": TritonBackendConfig(split_kv="never")}
        num_splits = choose_num_splits(batch, NUM_KV_HEADS, context, props.multi_processor_count)
        captured = choose_num_splits(batch, NUM_KV_HEADS, ns.captured_max_len,
                                     props.multi_processor_count)
        if captured > 1:
            configs[f"as_captured_{captured}_splits"] = TritonBackendConfig(
                split_kv="always", num_splits=captured)
        if num_splits > 1:
            configs["split_x2"] = TritonBackendConfig(
                split_kv="always", num_splits=min(2 * num_splits, 64)
            )
            configs["split_half"] = TritonBackendConfig(
                split_kv="always", num_splits=max(num_splits // 2, 1)
            )
        if ns.sweep:
            for tiles in DECODE_SWEEP:
                configs["unified_" + _sweep_name(tiles)] = _unified_tiles(tiles)
            if max(num_splits, captured) > 1:
                for tiles in SPLIT_SWEEP:  # at the captured graphs' split count
                    configs["split_" + _sweep_name(tiles)] = _split_tiles(
                        tiles, max(num_splits, captured))
        record = run_decode(timer, copy_bps, batch, context, configs, cache_dtype)
        report["decode"].append(record)
        write_record(ns.output, record)
        for label, run in record["runs"].items():
            if "error" in run:
                print(f"decode batch {batch:4d} ctx {context:5d} {label:22s} {run['error']}")
                continue
            print(
                f"decode batch {batch:4d} ctx {context:5d} {label:22s} {run['us']:9.1f} us "
                f"{run['bytes_per_s'] / 1e12:5.2f} TB/s  {run['fraction_of_copy']:5.1%} of copy  "
                f"max|diff| {run['max_abs_diff_vs_torch_ref']:.1e}"
            )

    backend = TritonBackend()
    for batch, context in fused_cases:
        # The tiles the backend gives the fused kernel, the unified kernel's for this batch
        # (what the fused kernel ran with before db6d40c), and with --sweep the
        # decode grid.
        tiles = {"fused": backend.fused_decode_tiles(batch, context, NUM_KV_HEADS, cache_dtype,
                                                     device),
                 "fused_unified_tiles": backend.decode_plan(batch, NUM_KV_HEADS, context,
                                                            device, cache_dtype)[1]}
        if ns.sweep:
            tiles.update(("fused_" + _sweep_name(t), t) for t in DECODE_SWEEP)
        record = run_fused(timer, copy_bps, batch, context, tiles, cache_dtype)
        report.setdefault("fused_decode", []).append(record)
        write_record(ns.output, record)
        for label, run in record["runs"].items():
            if "error" in run:
                print(f"fused decode batch {batch:4d} ctx {context:5d} {label:24s} "
                      f"{run['error']}")
                continue
            print(f"fused decode batch {batch:4d} ctx {context:5d} {label:24s} "
                  f"{run['us']:9.1f} us {run['bytes_per_s'] / 1e12:5.2f} TB/s  "
                  f"{run['fraction_of_copy']:5.1%} of copy  "
                  f"max|diff| {run['max_abs_diff_vs_two_launches']:.1e}")

    for prompt_len in [int(n) for n in ns.prefill_lens.split(",") if n.strip()]:
        configs = {"auto": TritonBackendConfig()}
        if ns.sweep:
            for tiles in PREFILL_SWEEP:
                configs[_sweep_name(tiles)] = TritonBackendConfig(prefill_tiles=tiles)
        record = run_prefill(timer, prompt_len, configs)
        report["prefill"].append(record)
        write_record(ns.output, record)
        for label, run in record["runs"].items():
            if "error" in run:
                print(f"prefill {prompt_len:5d} {label:28s} {run['error']}")
                continue
            print(
                f"prefill {prompt_len:5d} {label:28s} {run['us']:9.1f} us "
                f"{run['tflops']:6.1f} TFLOP/s  max|diff| {run.get('max_abs_diff_vs_sdpa', 0):.1e}"
            )

    mixed = run_mixed(timer, *MIXED_CASE)
    report["mixed"] = mixed
    write_record(ns.output, record)
    print(
        f"mixed {mixed['decodes']} decodes x ctx {mixed['context']} + {mixed['chunk']}-token "
        f"chunk: {mixed['mixed_us']:.1f} us (one launch: {mixed['mixed_one_launch_us']:.1f}); "
        f"as two steps "
        f"{mixed['decodes_only_us']:.1f} + {mixed['prefill_only_us']:.1f} us "
        f"(ratio {mixed['mixed_over_separate']:.2f})"
    )
    print(f"wrote {ns.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
