"""`sluice bench serve-vs-offline`: the same prompts through `LLM.generate` and through
`sluice serve`, in one run on one machine, so the server's cost is a ratio (issue 20's serving
target: at least 90% of offline throughput with every request sent at once, and a low mean TTFT
at a bounded concurrency).

    sluice bench serve-vs-offline --num-prompts 256 --random-input-len 562 \\
        --random-output-len 562 --random-range-ratio 0.82 --temperature 0.6 \\
        --max-concurrency inf,32 --num-clients 1,4 \\
        --output benchmarks/results/serving/DATE-serve-vs-offline-h200.json
        [--server-args '--api-server-count 2']

The prompts are `sluice bench serve`'s random dataset (text of the asked token lengths, drawn
with the model's tokenizer and `--seed`), each with its own output length and ignore_eos, as
the server is sent them. First the offline engine: one warm-up generate of a few short
requests, then one timed generate of every prompt, all at once; the engine is then shut down
and its memory freed. Then one server with the same engine flags, and `sluice bench serve`
against it for every `--max-concurrency` (inf: all at once) and `--num-clients` (load
generator processes: if 1 and 4 agree and the client CPU utilisation stays well below 1, the
client was not the limit). It prints each run's output throughput as a fraction of offline, its
TTFT and TPOT, and the clients' CPU utilisation, and saves everything with the command and the
machine.

On a CPU with a tiny model it is a smoke test: `--device cpu --model PATH --dtype float32` and
small lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sluice.bench.serve import (
    ServeBenchConfig,
    add_served_model_args,
    machine_line,
    run_benchmark,
)

_METRICS = ("ttft", "tpot", "itl")
_WARMUP_REQUESTS, _WARMUP_MAX_TOKENS = 4, 8


def _parse_concurrencies(text: str) -> list[int | None]:
    values: list[int | None] = []
    for word in text.split(","):
        word = word.strip()
        if word in ("inf", "none"):
            values.append(None)
            continue
        try:
            value = int(word)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"--max-concurrency takes integers >= 1 or inf, got {word!r}")
        values.append(value)
    return values


def _parse_clients(text: str) -> list[int]:
    try:
        values = [int(word) for word in text.split(",")]
    except ValueError:
        values = [0]
    if any(v < 1 for v in values):
        raise ValueError(f"--num-clients takes integers >= 1, got {text!r}")
    return values


def _engine_flags(ns: argparse.Namespace) -> list[str]:
    """The engine flags both halves run with (`sluice serve` syntax)."""
    flags = ["--device", ns.device, "--max-model-len", str(ns.max_model_len),
             "--gpu-memory-utilization", str(ns.gpu_memory_utilization)]
    if ns.dtype:
        flags += ["--dtype", ns.dtype]
    return flags + shlex.split(ns.engine_args or "")


def _offline_engine_args(ns: argparse.Namespace) -> Any:
    from sluice.engine.flags import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser(prog="sluice bench serve-vs-offline --engine-args")
    add_engine_args(parser)
    engine_ns = parser.parse_args(["--model", ns.model, *_engine_flags(ns)])
    return engine_args_from(engine_ns)


def _workload(ns: argparse.Namespace) -> list[Any]:
    """The prompts `sluice bench serve` draws for the same flags and seed."""
    import numpy as np

    from sluice.bench import datasets
    from sluice.bench.serve import load_tokenizer

    tokenizer = load_tokenizer(ns.tokenizer or ns.model)
    return datasets.sample_random(ns.num_prompts, ns.random_input_len, ns.random_output_len,
                                  ns.random_range_ratio, np.random.default_rng(ns.seed),
                                  tokenizer)


def run_offline(ns: argparse.Namespace, samples: list[Any]) -> dict[str, Any]:
    from sluice import LLM, SamplingParams
    from sluice.bench.offline_report import synchronize
    from sluice.bench.throughput import release_device_memory
    from sluice.worker.model_runner import resolve_device

    engine_args = _offline_engine_args(ns)
    llm = LLM(**vars(engine_args))
    device = resolve_device(engine_args.device)
    try:
        warmup = SamplingParams(temperature=ns.temperature, ignore_eos=True,
                                max_tokens=_WARMUP_MAX_TOKENS)
        llm.generate([s.prompt for s in samples[:_WARMUP_REQUESTS]], warmup, use_tqdm=False)
        params = [SamplingParams(temperature=ns.temperature, ignore_eos=True,
                                 max_tokens=s.expected_output_len) for s in samples]
        synchronize(device)
        start = time.perf_counter()
        outputs = llm.generate([s.prompt for s in samples], params, use_tqdm=False)
        synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    del llm, outputs
    release_device_memory(device)
    return {"seconds": seconds, "output_tokens": generated, "prompt_tokens": prompt_tokens,
            "output_throughput": generated / seconds}


def run_served(ns: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    from sluice.bench.serve_metrics import parse_goodput
    from sluice.testing.pd_cluster import Instance, serve_argv, start_instances
    from sluice.testing.servers import free_port

    port = free_port()
    server = Instance("server", serve_argv(ns.model, port, "--served-model-name", "bench",
                                           *_engine_flags(ns), *shlex.split(ns.server_args)),
                      port, workdir)
    runs = []
    start_instances([server], ns.start_timeout)
    try:
        print(f"--- server: {server.url}", flush=True)
        for concurrency in _parse_concurrencies(ns.max_concurrency):
            for num_clients in _parse_clients(ns.num_clients):
                label = (f"concurrency {'inf' if concurrency is None else concurrency}, "
                         f"{num_clients} client process(es)")
                print(f"--- {label}", flush=True)
                config = ServeBenchConfig(
                    base_url=server.url, endpoint="/v1/completions", model="bench",
                    tokenizer=ns.tokenizer or ns.model, dataset_name="random",
                    num_prompts=ns.num_prompts, random_input_len=ns.random_input_len,
                    random_output_len=ns.random_output_len,
                    random_range_ratio=ns.random_range_ratio, shared_prefix_len=0,
                    shared_prefix_groups=1, request_rate=math.inf, burstiness=1.0,
                    max_concurrency=concurrency, seed=ns.seed, goodput=parse_goodput([]),
                    ignore_eos=True, temperature=ns.temperature, percentile_metrics=_METRICS,
                    metric_percentiles=(50.0, 99.0), num_warmups=ns.num_warmups,
                    disable_tqdm=True, api_key=None, num_clients=num_clients)
                result = asyncio.run(run_benchmark(config))
                runs.append({"max_concurrency": concurrency, "num_clients": num_clients,
                             **{k: v for k, v in result.items() if not isinstance(v, list)}})
    finally:
        server.stop()
    return runs


def _table(offline: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    lines = [f"offline LLM.generate: {offline['output_throughput']:,.0f} output tok/s "
             f"({offline['output_tokens']:,} tokens in {offline['seconds']:.2f} s)",
             f"{'concurrency':>11} {'clients':>7} {'tok/s':>9} {'/offline':>8} "
             f"{'TTFT mean':>9} {'p50':>7} {'p99':>7} {'TPOT':>6} {'client CPU':>10}"]
    for run in runs:
        concurrency = "inf" if run["max_concurrency"] is None else str(run["max_concurrency"])
        util = run.get("client_cpu_util") or {}
        lines.append(
            f"{concurrency:>11} {run['num_clients']:>7} {run['output_throughput']:>9,.0f} "
            f"{run['fraction_of_offline']:>8.3f} "
            f"{run['mean_ttft_ms']:>9.1f} {run['median_ttft_ms']:>7.1f} "
            f"{run['p99_ttft_ms']:>7.1f} {run['mean_tpot_ms']:>6.2f} "
            f"{util.get('max', math.nan):>10.2f}")
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    _parse_concurrencies(ns.max_concurrency)
    _parse_clients(ns.num_clients)
    if ns.model is None:
        from sluice.bench.workloads import benchmark_model_dir, cache_root

        ns.model = benchmark_model_dir(cache_root(dict(os.environ)))
    command = shlex.join(["sluice", "bench", "serve-vs-offline", *sys.argv[3:]])
    print(command)
    print(machine_line())
    samples = _workload(ns)
    offline = run_offline(ns, samples)
    print(f"offline: {offline['output_throughput']:,.0f} output tok/s", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-serve-vs-offline-"))
    runs = run_served(ns, workdir)
    for run in runs:
        run["fraction_of_offline"] = run["output_throughput"] / offline["output_throughput"]
    print(_table(offline, runs))
    if ns.output:
        from sluice.bench.record import make_record, write_record

        results = {"model": ns.model,
                   "workload": {k: getattr(ns, k) for k in (
                       "num_prompts", "random_input_len", "random_output_len",
                       "random_range_ratio", "temperature", "seed")},
                   "server_args": ns.server_args,
                   "offline": offline, "served": runs}
        write_record(ns.output, make_record("serve-vs-offline", results, device=ns.device,
                                            command=shlex.split(command)))
        print(f"results saved to {ns.output}")
    return 0 if all(run["completed"] == ns.num_prompts for run in runs) else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve-vs-offline", help="the same prompts offline and through sluice serve, same run",
        description=__doc__.split("\n\n")[0])
    add_served_model_args(parser, max_model_len=4096, gpu_memory_utilization=0.9)
    parser.add_argument("--engine-args", default="",
                        help="more engine flags for both halves, quoted")
    parser.add_argument("--server-args", default="",
                        help="flags for the server only, quoted (e.g. '--api-server-count 2')")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--random-input-len", type=int, default=562)
    parser.add_argument("--random-output-len", type=int, default=562)
    parser.add_argument("--random-range-ratio", type=float, default=0.82)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-concurrency", default="inf,32",
                        help="comma-separated; inf: every request at once (default: inf,32)")
    parser.add_argument("--num-clients", default="1,4",
                        help="load generator processes, comma-separated (default: 1,4)")
    parser.add_argument("--num-warmups", type=int, default=1,
                        help="requests sent to the server before each timed run")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--output", default=None, help="JSON file for the results")
    parser.set_defaults(func=main)
    return parser
