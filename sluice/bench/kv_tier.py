"""`sluice bench kv-tier`: time to first token of a long prompt computed, served from the GPU
prefix cache, and loaded from the CPU tier (the OffloadingConnector), with the load's bandwidth
against the machine's host-to-device copy bandwidth measured in the same run.

Per prompt length and iteration, one fresh random prompt is generated to one token three
times: cold (every token computed; its full blocks are saved to the CPU tier meanwhile), again
(a GPU prefix hit), and again after the GPU prefix cache is emptied (a CPU-tier hit: the full
blocks load layer by layer while the last token computes). Medians are reported; each case's
`num_cached_tokens` is checked, so the numbers are of the path they name.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

_DEFAULT_TIER_GIB = 8.0


def add_parser(bench_sub: Any) -> None:
    from sluice.engine.flags import add_engine_args

    parser = bench_sub.add_parser(
        "kv-tier", help="TTFT recomputed vs GPU prefix hit vs CPU-tier hit, load bandwidth")
    parser.add_argument("--prompt-lens", default="2048,8192",
                        help="prompt lengths, comma-separated (default: 2048,8192)")
    parser.add_argument("--num-iters", type=int, default=3, help="prompts per length (median)")
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    add_engine_args(parser)
    parser.set_defaults(func=_cmd_kv_tier)


def copy_bandwidth(num_bytes: int, device: Any) -> dict[str, float]:
    """GB/s of one pinned host -> device copy and back (CUDA), median of five."""
    import torch

    if device.type != "cuda":
        return {}
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    results = {}
    for name, dst, src in (("h2d_gb_s", dev, host), ("d2h_gb_s", host, dev)):
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        results[name] = num_bytes / statistics.median(times) / 1e9
    return results


def run_kv_tier(ns: argparse.Namespace) -> dict[str, Any]:
    from sluice import SamplingParams
    from sluice.bench import offline_report as report
    from sluice.bench.latency import parse_sizes
    from sluice.bench.record import make_record
    from sluice.bench.throughput import build_llm
    from sluice.bench.workloads import random_prompts

    if ns.kv_offloading_size is None and ns.kv_transfer_config is None:
        ns.kv_offloading_size = _DEFAULT_TIER_GIB
    prompt_lens = parse_sizes("prompt_lens", ns.prompt_lens)
    llm, device, dtype = build_llm(ns)
    engine = llm.llm_engine
    max_model_len = engine.scheduler_config.max_model_len
    if max(prompt_lens) >= max_model_len:
        raise ValueError(f"prompt lengths must be < max_model_len ({max_model_len}), "
                         f"got {max(prompt_lens)}")
    connector = engine.scheduler.connector
    block_size = engine.cache_config.block_size
    bytes_per_block = connector.kv_cache_spec.bytes_per_block
    rng = random.Random(ns.seed)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        report.synchronize(device)
        start = time.perf_counter()
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        report.synchronize(device)
        return time.perf_counter() - start, output.num_cached_tokens

    # Warm-up: each path once at the shortest length.
    warm = random_prompts(1, min(prompt_lens), engine.hf_config.vocab_size, rng)[0]
    for _ in range(2):
        ttft(warm)
    engine.kv_cache_manager.reset_prefix_cache()
    ttft(warm)

    rows = []
    for length in prompt_lens:
        full = (length - 1) // block_size * block_size
        cases: dict[str, list[float]] = {"recompute": [], "gpu_hit": [], "cpu_hit": []}
        loaded_before = connector.get_stats()["loaded_blocks"]
        for prompt in random_prompts(ns.num_iters, length, engine.hf_config.vocab_size, rng):
            elapsed, cached = ttft(prompt)
            assert cached == 0, f"a fresh prompt hit {cached} tokens"
            cases["recompute"].append(elapsed)
            elapsed, cached = ttft(prompt)
            assert cached == full, f"GPU hit of {cached} tokens, expected {full}"
            cases["gpu_hit"].append(elapsed)
            if not engine.kv_cache_manager.reset_prefix_cache():
                raise RuntimeError("the GPU prefix cache could not be emptied (blocks in use)")
            elapsed, cached = ttft(prompt)
            assert cached == full, f"CPU-tier hit of {cached} tokens, expected {full}"
            cases["cpu_hit"].append(elapsed)
        loaded = connector.get_stats()["loaded_blocks"] - loaded_before
        assert loaded == ns.num_iters * full // block_size, "not every CPU hit was a load"
        medians = {name: statistics.median(times) for name, times in cases.items()}
        load_bytes = full // block_size * bytes_per_block
        rows.append({
            "prompt_len": length,
            "ttft_ms": {name: 1e3 * t for name, t in medians.items()},
            "cpu_hit_vs_recompute": medians["cpu_hit"] / medians["recompute"],
            "gpu_hit_vs_recompute": medians["gpu_hit"] / medians["recompute"],
            "load_bytes": load_bytes,
            # An upper bound of the load's time: the whole TTFT of the CPU hit.
            "effective_load_gb_s": load_bytes / medians["cpu_hit"] / 1e9,
        })
    bandwidth = copy_bandwidth(1 << 30, device)
    for row in rows:
        if bandwidth:
            row["load_vs_h2d_copy"] = row["effective_load_gb_s"] / bandwidth["h2d_gb_s"]
    return make_record("kv-tier", {
        "model": engine.model_config.model,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "block_size": block_size,
        "bytes_per_block": bytes_per_block,
        "num_iters": ns.num_iters,
        "copy_bandwidth": bandwidth,
        "rows": rows,
    }, device=device, command=getattr(ns, "sluice_argv", None))


def format_kv_tier(record: dict[str, Any]) -> str:
    from sluice.bench.record import command_text, describe_machine

    results = record["results"]
    lines = [f"command: {command_text(record)}",
             f"machine: {describe_machine(record['machine'])}",
             f"model: {results['model']} ({results['dtype']}, {results['device']}), "
             f"{results['bytes_per_block']} bytes per block of {results['block_size']} tokens, "
             f"median of {results['num_iters']}"]
    bandwidth = results["copy_bandwidth"]
    if bandwidth:
        lines.append(f"pinned copy, 1 GiB: host->device {bandwidth['h2d_gb_s']:.1f} GB/s, "
                     f"device->host {bandwidth['d2h_gb_s']:.1f} GB/s")
    lines.append(f"{'prompt':>7} {'recompute':>10} {'GPU hit':>9} {'CPU hit':>9} "
                 f"{'CPU/recomp':>10} {'load GB/s':>9} {'of H2D':>7}  (TTFT ms)")
    for row in results["rows"]:
        t = row["ttft_ms"]
        of_copy = f"{row['load_vs_h2d_copy']:.0%}" if "load_vs_h2d_copy" in row else "-"
        lines.append(f"{row['prompt_len']:>7} {t['recompute']:>10.2f} {t['gpu_hit']:>9.2f} "
                     f"{t['cpu_hit']:>9.2f} {row['cpu_hit_vs_recompute']:>10.2f} "
                     f"{row['effective_load_gb_s']:>9.2f} {of_copy:>7}")
    return "\n".join(lines)


def _cmd_kv_tier(ns: argparse.Namespace) -> int:
    from sluice.bench.record import write_record

    record = run_kv_tier(ns)
    print(format_kv_tier(record))
    if ns.output:
        write_record(ns.output, record)
    return 0
