"""The persistent decode kernel against the layer-by-layer kernels on a GPU, model level: the
benchmark model's decoder layers for decode batches of 1-8 rows over a paged cache of random
K/V, each path in a CUDA graph of the whole forward (embedding, layers, final norm).

For each batch size: device time per forward (graph replays timed with CUDA events), and the
hidden states of both paths against the same weights in float32 (max abs error), so a faster
kernel that computes something else shows. `--tiles` adds variants of the kernel's tiles.

    PYTHONPATH=. python scripts/persistent_decode_bench.py OUT.json [--rows 1,2,4,8]
        [--context 256] [--tiles '[{"qkv": 16}, {"block_k": 1024}]'] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from sluice.attention.metadata import AttentionMetadata
from sluice.attention.triton_backend import TritonBackend
from sluice.bench.workloads import benchmark_model_dir, cache_root
from sluice.model.attention import attention_layers, bind_kv_caches
from sluice.model.hf_config import load_hf_config
from sluice.model.loader import load_model
from sluice.model.persistent_decode import PersistentDecode, Tiles
from sluice.worker.compile import install_fused_ops

BLOCK_SIZE = 16


def decode_metadata(rows: int, context: int, device: torch.device) -> AttentionMetadata:
    """`rows` requests of `context` keys each (this step's token the last), request i in blocks
    [i * width, (i + 1) * width)."""
    width = -(-context // BLOCK_SIZE)
    seq_lens = torch.full((rows,), context, dtype=torch.int32)
    slots = torch.tensor([i * width * BLOCK_SIZE + context - 1 for i in range(rows)])
    return AttentionMetadata(
        num_actual_tokens=rows, max_query_len=1, max_seq_len=context,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(device),
        block_tables=torch.arange(rows * width, dtype=torch.int32,
                                  device=device).view(rows, width),
        slot_mapping=slots.to(device), query_start_loc_cpu=torch.arange(rows + 1),
        seq_lens_cpu=seq_lens)


def build(model_dir: str, dtype: torch.dtype, num_blocks: int, persistent: bool,
          device: torch.device) -> torch.nn.Module:
    config = load_hf_config(model_dir)
    model = load_model(model_dir, config, dtype, device, TritonBackend())
    install_fused_ops(model, persistent_decode=persistent)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (2, num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = {name: (torch.randn(shape, generator=generator, device=device) * 2).to(dtype)
              for name in attention_layers(model)}
    bind_kv_caches(model, caches)
    return model


def time_graph(model: torch.nn.Module, inputs: tuple, iters: int = 200) -> float:
    """Microseconds per replay of a CUDA graph of `model(*inputs)`."""
    for _ in range(2):
        model(*inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(*inputs)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--tiles", default="[]", help="JSON list of Tiles field overrides")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    model_dir = args.model or benchmark_model_dir(cache_root(dict(os.environ)))
    rows_list = [int(r) for r in args.rows.split(",")]
    width = -(-args.context // BLOCK_SIZE)
    num_blocks = max(rows_list) * width + 1
    results: dict = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "host": platform.node()},
        "model": model_dir, "context": args.context, "points": []}
    layered = build(model_dir, torch.bfloat16, num_blocks, False, device)
    t0 = time.perf_counter()
    persistent = build(model_dir, torch.bfloat16, num_blocks, True, device)
    exact = build(model_dir, torch.float32, num_blocks, False, device)
    for name in attention_layers(persistent):  # the same K/V in all three
        cache = attention_layers(layered)[name].kv_cache
        attention_layers(persistent)[name].kv_cache.copy_(cache)
        attention_layers(exact)[name].kv_cache.copy_(cache.float())
    results["build_s"] = time.perf_counter() - t0
    vocab = layered.config.vocab_size
    variants = [Tiles(**overrides) for overrides in json.loads(args.tiles)]
    with torch.inference_mode():
        for rows in rows_list:
            metadata = decode_metadata(rows, args.context, device)
            ids = torch.randint(0, vocab, (rows,), device=device)
            positions = torch.full((rows,), args.context - 1, device=device)
            inputs = (ids, positions, metadata)
            point: dict = {"rows": rows}
            outputs = {}
            for label, model in (("layered", layered), ("persistent", persistent),
                                 ("float32", exact)):
                t0 = time.perf_counter()
                outputs[label] = model(*inputs).float()
                torch.cuda.synchronize()
                point[f"{label}_first_call_s"] = time.perf_counter() - t0
            for label in ("layered", "persistent"):
                point[f"{label}_max_abs_error"] = (
                    outputs[label] - outputs["float32"]).abs().max().item()
            point["persistent_vs_layered_max_abs"] = (
                outputs["persistent"] - outputs["layered"]).abs().max().item()
            point["layered_us"] = time_graph(layered, inputs)
            point["persistent_us"] = time_graph(persistent, inputs)
            point["speedup"] = point["layered_us"] / point["persistent_us"]
            for tiles in variants:
                op = PersistentDecode(persistent.model, tiles)
                persistent.model.decode_layers_op = op.run
                out = persistent(*inputs).float()
                point.setdefault("variants", []).append({
                    "tiles": str(tiles),
                    "us": time_graph(persistent, inputs),
                    "max_abs_error": (out - outputs["float32"]).abs().max().item()})
            persistent.model.decode_layers_op = PersistentDecode(persistent.model).run
            print(json.dumps(point), flush=True)
            results["points"].append(point)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
