"""`sluice bench router`: the router over N plain replicas, one run per policy, on shared-prefix
traffic (issue 51's "cache-aware routing's prefix hit rate and TTFT better than round-robin's").

    sluice bench router --num-workers 2 --policies round_robin,least_loaded,cache_aware \\
        --num-prompts 400 --shared-prefix-len 2048 --shared-prefix-groups 32 --suffix-len 128 \\
        --output-len 64 --request-rate 8 \\
        --output benchmarks/results/serving/DATE-router-policies-h200.json

For each policy it starts the replicas afresh (empty prefix caches; with two or more GPUs
visible, replica i on GPU i, else one after the other on the one device with
`--gpu-memory-utilization` each) and a `sluice router --worker ... --policy P` over them, warms
each replica with one unrelated request, and sends `sluice bench serve`'s shared-prefix load
(groups of prompts sharing a long prefix, in shuffled order) through the router. The workload,
seed and replica flags are the same for every policy. Per policy it prints the prefix hit rate
(prompt tokens the replicas found in their prefix caches over the prompt tokens they looked up,
from their own /metrics), how the requests spread over the replicas, and mean / P99 TTFT, and
the ratios against round_robin, measured in the same run; it saves everything as JSON with the
command and the machine.

The policies differ where the replicas' caches cannot each hold every prefix: round_robin
makes every replica compute every prefix, cache_aware keeps a prefix on the replica that has
it. `--engine-args "--num-gpu-blocks-override N"` bounds a replica's cache to show that on a
small machine. On a CPU with a tiny model it is a functional run (`--device cpu --model PATH
--dtype float32`, small sizes), not a measurement of TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from sluice.bench.serve import add_served_model_args, machine_line, run_benchmark
from sluice.bench.shared_prefix_load import (
    add_load_args,
    check_load_args,
    instance_flags,
    load_config,
    num_gpus,
    workload,
)
from sluice.router.policies import POLICIES

_SUMMARY = ("prefix_hit_rate", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
            "request_throughput", "output_throughput", "completed")
_COUNTERS = ("sluice:prefix_cache_queries_total", "sluice:prefix_cache_hits_total",
             "sluice:request_success_total", "sluice:prompt_tokens_total")


def worker_counters(url: str) -> dict[str, float]:
    """The replica's counters of _COUNTERS, summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(_COUNTERS, 0.0)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def _policies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if bad := [name for name in names if name not in POLICIES]:
        raise argparse.ArgumentTypeError(f"--policies takes {list(POLICIES)}, got {bad}")
    if "round_robin" not in names:
        names.insert(0, "round_robin")  # the baseline of the ratios
    return names


def _run_policy(ns: argparse.Namespace, policy: str, workdir: Path) -> dict[str, Any]:
    from sluice.testing.replica_cluster import start_replicas

    flags = instance_flags(ns)
    own_gpus = num_gpus(ns.device) >= ns.num_workers
    env = [{"CUDA_VISIBLE_DEVICES": str(i)} if own_gpus else {} for i in range(ns.num_workers)]
    # Replicas sharing a GPU size their cache from what is free: one after the other.
    cluster = start_replicas(ns.model, flags, ns.num_workers, workdir / policy, env,
                             one_at_a_time=not own_gpus and ns.device != "cpu",
                             timeout_s=ns.start_timeout)
    try:
        router = cluster.start_router(["--policy", policy, *shlex.split(ns.router_args or "")])
        urls = [w.url for w in cluster.workers]
        print(f"--- {policy}: router {router.url} over {', '.join(urls)}", flush=True)
        for url in urls:  # the first request's one-off costs, outside the timed run
            httpx.post(f"{url}/v1/completions", timeout=600, json={
                "model": "bench", "prompt": "warm up", "max_tokens": 2}).raise_for_status()
        before = [worker_counters(url) for url in urls]
        config = load_config(ns, router.url)
        result = asyncio.run(run_benchmark(config))
        after = [worker_counters(url) for url in urls]
    finally:
        cluster.close()
    replicas = [{name.removeprefix("sluice:").removesuffix("_total"): a[name] - b[name]
                 for name in _COUNTERS} for a, b in zip(after, before)]
    queries = sum(r["prefix_cache_queries"] for r in replicas)
    summary = {key: result.get(key, math.nan) for key in _SUMMARY if key in result}
    summary["prefix_hit_rate"] = (sum(r["prefix_cache_hits"] for r in replicas) / queries
                                  if queries else math.nan)
    summary["replicas"] = replicas
    return summary


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    base = results["round_robin"]
    out = {}
    for policy, row in results.items():
        out[policy] = {key: (row[key] / base[key] if base.get(key) else math.nan)
                       for key in ("prefix_hit_rate", "mean_ttft_ms", "p99_ttft_ms")}
    return out


def _table(results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]]) -> str:
    lines = [f"{'policy':<14}{'hit rate':>10}{'mean TTFT':>11}{'P99 TTFT':>10}"
             f"{'hit/rr':>9}{'mean/rr':>9}{'P99/rr':>9}  requests per replica"]
    for policy, row in results.items():
        ratio = ratios[policy]
        spread = " ".join(f"{r['request_success']:.0f}" for r in row["replicas"])
        lines.append(f"{policy:<14}{row['prefix_hit_rate']:>10.3f}{row['mean_ttft_ms']:>11.2f}"
                     f"{row['p99_ttft_ms']:>10.2f}{ratio['prefix_hit_rate']:>9.3f}"
                     f"{ratio['mean_ttft_ms']:>9.3f}{ratio['p99_ttft_ms']:>9.3f}  {spread}")
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    check_load_args(ns, "num_workers")
    command = shlex.join(["sluice", "bench", "router", *sys.argv[3:]])
    print(command)
    print(machine_line())
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-router-"))
    result: dict[str, Any] = {
        "model": ns.model, "num_workers": ns.num_workers, "gpus": num_gpus(ns.device),
        "engine_args": ns.engine_args, "router_args": ns.router_args,
        "workload": workload(ns),
        "policies": {}}
    for policy in ns.policies:
        result["policies"][policy] = _run_policy(ns, policy, workdir)
    result["vs_round_robin"] = _ratios(result["policies"])
    print(_table(result["policies"], result["vs_round_robin"]))
    if ns.output:
        from sluice.bench.record import make_record, write_record

        write_record(ns.output, make_record("router", result, device=ns.device,
                                            command=shlex.split(command)))
        print(f"results saved to {ns.output}")
    complete = all(row.get("completed") == ns.num_prompts
                   for row in result["policies"].values())
    return 0 if complete else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "router", help="the router over plain replicas, per policy, on shared-prefix traffic",
        description=__doc__.split("\n\n")[0])
    add_served_model_args(parser, max_model_len=8192, gpu_memory_utilization=0.4,
                          gpu_memory_help="each replica's share of its GPU (default: 0.4, so "
                                          "two fit one)")
    parser.add_argument("--engine-args", default="", help="more `sluice serve` flags, quoted")
    parser.add_argument("--router-args", default="", help="more `sluice router` flags, quoted")
    parser.add_argument("--num-workers", type=int, default=2, help="replicas (default: 2)")
    parser.add_argument("--policies", type=_policies, default=list(POLICIES),
                        help="comma-separated (default: all); round_robin, the baseline of "
                             "the ratios, is added first when missing")
    add_load_args(parser, num_prompts=400, shared_prefix_len=2048, shared_prefix_groups=32,
                  suffix_len=128, output_len=64, request_rate=8.0)
    parser.set_defaults(func=main)
    return parser
