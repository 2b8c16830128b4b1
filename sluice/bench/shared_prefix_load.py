"""What the benchmarks that start their own instances and load them with `sluice bench serve`'s
shared-prefix dataset share (`kv-pool-serve`, `router`): the load's flags, their checks, the
load's config, and how many GPUs the instances may spread over."""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

from sluice.bench.serve import ServeBenchConfig, model_tokenizer

PERCENTILE_METRICS = ("ttft", "tpot", "itl")
WORKLOAD_KEYS = ("num_prompts", "shared_prefix_len", "shared_prefix_groups", "suffix_len",
                 "output_len", "request_rate", "max_concurrency", "seed")


def add_load_args(parser: argparse.ArgumentParser, *, num_prompts: int, shared_prefix_len: int,
                  shared_prefix_groups: int, suffix_len: int, output_len: int,
                  request_rate: float) -> None:
    """The load's flags (defaults the benchmark's), and --seed, --start-timeout, --output."""
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--shared-prefix-len", type=int, default=shared_prefix_len)
    parser.add_argument("--shared-prefix-groups", type=int, default=shared_prefix_groups)
    parser.add_argument("--suffix-len", type=int, default=suffix_len,
                        help="tokens of each prompt after its shared prefix")
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--request-rate", type=float, default=request_rate)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--output", default=None, help="JSON file for the results")


def check_load_args(ns: argparse.Namespace, *more: str) -> None:
    """ValueError naming the first of the load's counts (and `more`) below 1; the default model
    (the Qwen3-0.6B architecture, random bf16) when none is given."""
    for flag in (*more, "num_prompts", "shared_prefix_groups", "shared_prefix_len",
                 "suffix_len", "output_len"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if ns.model is None:
        from sluice.bench.workloads import benchmark_model_dir, cache_root

        ns.model = benchmark_model_dir(cache_root(dict(os.environ)))


def instance_flags(ns: argparse.Namespace) -> list[str]:
    """The `sluice serve` flags of every instance: add_served_model_args's and --engine-args,
    served as "bench"."""
    flags = ["--device", ns.device, "--max-model-len", str(ns.max_model_len),
             "--served-model-name", "bench", "--gpu-memory-utilization",
             str(ns.gpu_memory_utilization), *shlex.split(ns.engine_args or "")]
    if ns.dtype:
        flags += ["--dtype", ns.dtype]
    return flags


def load_config(ns: argparse.Namespace, base_url: str, more_base_urls: tuple[str, ...] = ()
                ) -> ServeBenchConfig:
    """The shared-prefix load of `ns` against the instances named "bench" at `base_url` (and
    `more_base_urls`, each request to one of them at random); no warm-up requests."""
    from sluice.bench.serve_metrics import parse_goodput

    return ServeBenchConfig(
        base_url=base_url, more_base_urls=more_base_urls, endpoint="/v1/completions",
        model="bench", tokenizer=model_tokenizer(ns), dataset_name="shared-prefix",
        num_prompts=ns.num_prompts, random_input_len=ns.suffix_len,
        random_output_len=ns.output_len, random_range_ratio=0.0,
        shared_prefix_len=ns.shared_prefix_len, shared_prefix_groups=ns.shared_prefix_groups,
        request_rate=ns.request_rate, burstiness=1.0, max_concurrency=ns.max_concurrency,
        seed=ns.seed, goodput=parse_goodput(ns.goodput or []), ignore_eos=True,
        temperature=0.0, percentile_metrics=PERCENTILE_METRICS, metric_percentiles=(99.0,),
        num_warmups=0, disable_tqdm=True, api_key=None)


def workload(ns: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(ns, key) for key in WORKLOAD_KEYS}


def num_gpus(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    import torch

    return torch.cuda.device_count()


REUSE_CLASSES = ("first", "other_instance", "same_instance")


def ttft_by_reuse(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """TTFT (ms) of a shared-prefix run (`run_benchmark`'s result) by what each request's
    prefix had met before it, in arrival order: `first` (its group's first request anywhere),
    `other_instance` (its group seen only on another instance: a pool hit, or a miss without
    one), `same_instance` (a local prefix hit, unless evicted or still being computed). Per
    class: count, mean, median, P99 and max; failed requests are left out."""
    seen_groups: set[int] = set()
    seen_pairs: set[tuple[int, int]] = set()
    ttfts: dict[str, list[float]] = {name: [] for name in REUSE_CLASSES}
    for group, target, ttft, error in zip(result["prefix_groups"], result["targets"],
                                          result["ttfts"], result["errors"]):
        if group is None:
            continue
        if group not in seen_groups:
            name = "first"
        elif (group, target) not in seen_pairs:
            name = "other_instance"
        else:
            name = "same_instance"
        seen_groups.add(group)
        seen_pairs.add((group, target))
        if not error:
            ttfts[name].append(ttft * 1e3)
    out: dict[str, dict[str, float]] = {}
    for name, values in ttfts.items():
        if values:
            ordered = sorted(values)
            out[name] = {"count": len(values), "mean_ms": sum(values) / len(values),
                         "median_ms": ordered[len(ordered) // 2],
                         "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
                         "max_ms": ordered[-1]}
    return out


def reuse_table(settings: dict[str, dict[str, dict[str, float]]]) -> str:
    """The `ttft_by_reuse` of each setting (name -> classes), one line per setting and class."""
    lines = [f"{'setting':<14}{'class':<16}{'count':>6}{'mean':>9}{'median':>9}{'p99':>9}"
             f"{'max':>9}  (TTFT ms by prefix reuse)"]
    for setting, classes in settings.items():
        for name, row in classes.items():
            lines.append(f"{setting:<14}{name:<16}{row['count']:>6.0f}{row['mean_ms']:>9.1f}"
                         f"{row['median_ms']:>9.1f}{row['p99_ms']:>9.1f}{row['max_ms']:>9.1f}")
    return "\n".join(lines)
