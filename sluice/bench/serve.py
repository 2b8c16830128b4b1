"""`sluice bench serve`: load an OpenAI-compatible server (sluice's, vLLM's, ...) and print the
result block of `vllm bench serve`, with its flags and its JSON keys.

Requests arrive as a Poisson process at `--request-rate` (gamma intervals of shape
`--burstiness`; all at once for `inf`), at most `--max-concurrency` in flight; each streams and is
timed on the client (openai_client.py); metrics follow vLLM's definitions (serve_metrics.py).
The prompts and arrival times are drawn here; `--num-clients N` sends them from N client
processes (load_clients.py) so that the client is not the limit, and each run reports the client
processes' CPU utilisation to show whether one was.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from sluice.bench import datasets
from sluice.bench.load_clients import (
    ClientsRun,
    concurrency_shares,
    run_in_process,
    run_in_processes,
)
from sluice.bench.openai_client import RequestInput, first_model
from sluice.bench.serve_metrics import (
    PERCENTILE_METRICS,
    compute_metrics,
    format_result_block,
    parse_goodput,
    result_dict,
)
from sluice.event_loop import run_event_loop

DATASETS = ("random", "shared-prefix")


def arrival_times(num_requests: int, request_rate: float, burstiness: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Send offsets in seconds, [num_requests], non-decreasing.

    Intervals are gamma(shape=burstiness, mean=1/rate): burstiness 1 is a Poisson process, lower
    is burstier (coefficient of variation 1/sqrt(burstiness)), inf is evenly spaced. As in vLLM,
    the offsets are then scaled so the last one is num_requests / rate, which keeps the offered
    load of a short run from drifting with the seed.
    """
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        intervals = np.full(num_requests, 1.0 / request_rate)
    else:
        intervals = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                              size=num_requests)
    offsets = np.cumsum(intervals)
    return offsets * (num_requests / request_rate) / offsets[-1]


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    base_url: str
    endpoint: str
    model: str | None
    tokenizer: str | None
    dataset_name: str
    num_prompts: int
    random_input_len: int
    random_output_len: int
    random_range_ratio: float
    shared_prefix_len: int
    shared_prefix_groups: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int
    goodput: dict[str, float]
    ignore_eos: bool
    temperature: float | None
    percentile_metrics: tuple[str, ...]
    metric_percentiles: tuple[float, ...]
    num_warmups: int
    disable_tqdm: bool
    api_key: str | None
    # More servers of the same model: each request goes to one of base_url and these, drawn at
    # random (seeded apart from the workload, so the prompts and arrivals stay the same).
    more_base_urls: tuple[str, ...] = ()
    # Client processes sending the requests (load_clients.py); 1 sends them from this process.
    num_clients: int = 1

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def backend(self) -> str:
        return "openai-chat" if self.chat else "openai"


def config_from_args(ns: argparse.Namespace) -> ServeBenchConfig:
    base_urls = [url.rstrip("/") for url in ns.base_url or [f"http://{ns.host}:{ns.port}"]]
    if not ns.endpoint.rstrip("/").endswith("completions"):
        raise ValueError(f"--endpoint must be /v1/completions or /v1/chat/completions, "
                         f"got {ns.endpoint!r}")
    if ns.dataset_name not in DATASETS:
        raise ValueError(f"--dataset-name must be one of {list(DATASETS)}, got "
                         f"{ns.dataset_name!r}")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    concurrency_shares(ns.max_concurrency, ns.num_clients)  # checks --num-clients
    if ns.num_clients > ns.num_prompts:
        raise ValueError(f"--num-clients ({ns.num_clients}) must be <= --num-prompts "
                         f"({ns.num_prompts})")
    metrics = tuple(m.strip() for m in ns.percentile_metrics.split(",") if m.strip())
    if bad := [m for m in metrics if m not in PERCENTILE_METRICS]:
        raise ValueError(f"--percentile-metrics takes {list(PERCENTILE_METRICS)}, got {bad}")
    try:
        percentiles = tuple(float(p) for p in ns.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers, got "
                         f"{ns.metric_percentiles!r}") from None
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {percentiles}")
    return ServeBenchConfig(
        base_url=base_urls[0], more_base_urls=tuple(base_urls[1:]),
        endpoint="/" + ns.endpoint.lstrip("/"), model=ns.model,
        tokenizer=ns.tokenizer, dataset_name=ns.dataset_name, num_prompts=ns.num_prompts,
        random_input_len=ns.random_input_len, random_output_len=ns.random_output_len,
        random_range_ratio=ns.random_range_ratio, shared_prefix_len=ns.shared_prefix_len,
        shared_prefix_groups=ns.shared_prefix_groups, request_rate=ns.request_rate,
        burstiness=ns.burstiness, max_concurrency=ns.max_concurrency, seed=ns.seed,
        goodput=parse_goodput(ns.goodput or []),
        # Synthetic prompts: generation must run to the asked length, as vLLM's client asks.
        ignore_eos=True if ns.ignore_eos is None else ns.ignore_eos,
        temperature=ns.temperature, percentile_metrics=metrics, metric_percentiles=percentiles,
        num_warmups=ns.num_warmups, disable_tqdm=ns.disable_tqdm, api_key=ns.api_key,
        num_clients=ns.num_clients)


def model_tokenizer(ns: argparse.Namespace) -> str | None:
    """--tokenizer, else the model folder when it has a tokenizer: the prompts are then sized in
    the model's tokens (a server's model name such as "bench" names no folder)."""
    if ns.tokenizer:
        return ns.tokenizer
    folder = ns.model
    if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return folder
    return None


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _resolve_tokenizer(config: ServeBenchConfig, model_id: str, root: str) -> str | None:
    """--tokenizer, else the model (or the folder the server reports) when it is a local folder."""
    if config.tokenizer:
        return config.tokenizer
    return next((p for p in (model_id, root) if os.path.isdir(p)), None)


def sample_requests(config: ServeBenchConfig, tokenizer: Any | None,
                    rng: np.random.Generator) -> list[datasets.SampleRequest]:
    if config.dataset_name == "random":
        return datasets.sample_random(config.num_prompts, config.random_input_len,
                                      config.random_output_len, config.random_range_ratio, rng,
                                      tokenizer)
    return datasets.sample_shared_prefix(
        config.num_prompts, config.shared_prefix_groups, config.shared_prefix_len,
        config.random_input_len, config.random_output_len, config.random_range_ratio, rng,
        tokenizer)


async def _send_all(config: ServeBenchConfig, inputs: list[RequestInput],
                    offsets: np.ndarray) -> ClientsRun:
    progress = None
    if not config.disable_tqdm:
        from tqdm import tqdm

        progress = tqdm(total=len(inputs))
    on_done = None if progress is None else lambda: progress.update(1)
    try:
        if config.num_clients == 1:
            return await run_in_process(inputs, offsets.tolist(), config.max_concurrency,
                                        config.api_key, config.num_warmups, on_done)
        return await run_in_processes(inputs, offsets.tolist(), config.max_concurrency,
                                      config.num_clients, config.api_key, config.num_warmups,
                                      on_done)
    finally:
        if progress is not None:
            progress.close()


def _max_mean(values: list[float]) -> str:
    return f"{max(values):.2f} / {sum(values) / len(values):.2f}"


def client_cpu_lines(run: ClientsRun) -> list[str]:
    """The client's self-check, printed under the result block."""
    lines = [f"{'Client processes:':<40} {len(run.cpu_util):<10} ({run.event_loop})",
             f"{'Client CPU util (max / mean):':<40} {_max_mean(run.cpu_util)}"]
    busy = run.cpu_util
    if run.cpu_wait is not None:
        lines.append(f"{'Client CPU wait (max / mean):':<40} {_max_mean(run.cpu_wait)}")
        busy = [u + w for u, w in zip(run.cpu_util, run.cpu_wait)]
    if max(busy) > 0.9:
        lines.append("warning: a client process was busy (running, or waiting for a CPU) for "
                     "most of the run: the figures may be the client's limit; rerun with more "
                     "--num-clients, or on a host with more free cores")
    return lines


def _stats(values: list[float] | None) -> dict[str, Any] | None:
    if values is None:
        return None
    return {"max": max(values), "mean": sum(values) / len(values), "per_process": values}


async def run_benchmark(config: ServeBenchConfig) -> dict[str, Any]:
    """Run the benchmark, print the result block, return the result JSON."""
    rng = np.random.default_rng(config.seed)
    concurrency_shares(config.max_concurrency, config.num_clients)  # checks num_clients
    if config.model is None:
        model_id, root = await first_model(config.base_url, config.api_key)
        print(f"model (first listed by the server): {model_id}")
    else:
        model_id = root = config.model
    tokenizer_id = _resolve_tokenizer(config, model_id, root)
    tokenizer = None if tokenizer_id is None else load_tokenizer(tokenizer_id)
    print(f"tokenizer: {tokenizer_id or 'none (token counts from the server usage)'}")
    samples = sample_requests(config, tokenizer, rng)
    urls = [config.base_url, *config.more_base_urls]
    picks = np.random.default_rng(config.seed + 1).integers(len(urls), size=len(samples))
    inputs = [RequestInput(api_url=urls[pick] + config.endpoint, model=model_id,
                           prompt=s.prompt, prompt_len=s.prompt_len,
                           output_len=s.expected_output_len, ignore_eos=config.ignore_eos,
                           temperature=config.temperature, chat=config.chat)
              for s, pick in zip(samples, picks.tolist())]
    if config.num_warmups:
        # Sent before the timed run, by the client processes (split among them).
        print(f"Warming up with {config.num_warmups} requests...")
    offsets = arrival_times(len(inputs), config.request_rate, config.burstiness, rng)
    process = "Poisson process" if config.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {config.request_rate}")
    print(f"Burstiness factor: {config.burstiness} ({process})")
    print(f"Maximum request concurrency: {config.max_concurrency}")
    run = await _send_all(config, inputs, offsets)
    timings, duration = run.timings, run.duration_s

    count_tokens: Callable[[str], int] | None = None
    if tokenizer is not None:
        count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    metrics = compute_metrics(timings, duration, config.metric_percentiles, config.goodput,
                              count_tokens)
    failed = [t.error for t in timings if not t.success]
    if failed:
        print(f"Failed requests ({len(failed)}; the first 10):")
        for i, error in enumerate(failed[:10]):
            print(f"Error {i}: {error}")
    print(format_result_block(metrics, duration, config.request_rate, config.max_concurrency,
                              bool(config.goodput), config.percentile_metrics))
    print("\n".join(client_cpu_lines(run)))
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": config.backend,
        "backend": config.backend,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        **result_dict(metrics, timings, duration, bool(config.goodput),
                      config.percentile_metrics),
        "num_clients": config.num_clients,
        "client_event_loop": run.event_loop,
        # Per client process, over its run: CPU seconds / wall seconds (near 1: saturated), and
        # seconds runnable but waiting for a CPU / wall seconds (Linux; else None).
        "client_cpu_util": _stats(run.cpu_util),
        "client_cpu_wait": _stats(run.cpu_wait),
        # Per request, in arrival order: the server it went to (0: base_url, then
        # more_base_urls) and, for shared-prefix prompts, its prefix group.
        "targets": picks.tolist(),
        "prefix_groups": [s.group for s in samples],
    }


def add_served_model_args(parser: argparse.ArgumentParser, *, max_model_len: int,
                          gpu_memory_utilization: float, gpu_memory_help: str | None = None
                          ) -> None:
    """The model and engine flags of the benchmarks that start their own servers."""
    parser.add_argument("--model", default=None,
                        help="model folder (default: the Qwen3-0.6B architecture, random bf16)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=max_model_len)
    parser.add_argument("--gpu-memory-utilization", type=float, default=gpu_memory_utilization,
                        help=gpu_memory_help)


def machine_line() -> str:
    return (f"machine: {socket.gethostname()} | {os.cpu_count()} CPUs | {platform.platform()} | "
            f"Python {platform.python_version()}")


def command_line(ns: argparse.Namespace) -> str:
    """The run as a command with every flag resolved, defaults included."""
    words = ["sluice", "bench", "serve"]
    for flag, dest in ns.bench_serve_flags:
        value = getattr(ns, dest)
        if value is None or (value is False and flag in ("--save-result", "--disable-tqdm")):
            continue
        if value is True:
            words.append(flag)
        elif value is False:
            words.append("--no-" + flag[2:])
        elif isinstance(value, list) and dest == "base_url":  # repeated flag
            for url in value:
                words += [flag, url]
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        elif dest == "api_key":
            words += [flag, "***"]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def result_path(ns: argparse.Namespace, result: dict[str, Any]) -> str:
    concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency is not None else ""
    label = ns.label or result["backend"]
    name = ns.result_filename or (f"{label}-{ns.request_rate}qps{concurrency}-"
                                  f"{result['model_id'].rstrip('/').split('/')[-1]}-"
                                  f"{result['date']}.json")
    if ns.result_dir:
        os.makedirs(ns.result_dir, exist_ok=True)
        return os.path.join(ns.result_dir, name)
    return name


def main(ns: argparse.Namespace) -> int:
    config = config_from_args(ns)
    command = command_line(ns)
    print(command)
    print(machine_line())
    result = run_event_loop(run_benchmark(config))
    if ns.save_result:
        from sluice.bench.record import make_record, write_record

        # results: the keys of `vllm bench serve --save-result`, and the client processes' CPU.
        record = make_record("serve", {"label": ns.label, **result},
                             command=shlex.split(command))
        path = result_path(ns, result)
        write_record(path, record)
        print(f"results saved to {path}")
    return 0 if result["completed"] > 0 else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` under the `sluice bench` subcommands."""
    parser = subparsers.add_parser("serve", help="load an OpenAI-compatible server",
                                   description=__doc__.split("\n\n")[0])
    flags: list[tuple[str, str]] = []

    def add(flag: str, **kwargs: Any) -> None:
        action = parser.add_argument(flag, **kwargs)
        flags.append((flag, action.dest))

    add("--base-url", action="append", default=None,
        help="server URL (default: http://HOST:PORT); repeat for several servers of one model: "
             "each request goes to one of them at random")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", default="/v1/completions", help="/v1/completions | /v1/chat/completions")
    add("--model", default=None, help="model name (default: the first of GET /v1/models)")
    add("--tokenizer", default=None,
        help="tokenizer folder (default: the model, if a local folder; else the server's usage)")
    add("--dataset-name", default="random", choices=DATASETS)
    add("--num-prompts", type=int, default=1000)
    add("--random-input-len", type=int, default=1024,
        help="prompt tokens (the suffix after the shared prefix for shared-prefix)")
    add("--random-output-len", type=int, default=128)
    add("--random-range-ratio", type=float, default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]")
    add("--shared-prefix-len", type=int, default=256, help="tokens of each shared prefix")
    add("--shared-prefix-groups", type=int, default=10, help="number of distinct prefixes")
    add("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    add("--burstiness", type=float, default=1.0,
        help="gamma shape of arrival intervals (1: Poisson; < 1 burstier)")
    add("--max-concurrency", type=int, default=None)
    add("--num-clients", type=int, default=1,
        help="client processes sending the requests, each with its share of "
             "--max-concurrency (at most --max-concurrency): more when one client process is "
             "saturated (see its CPU util in the output)")
    add("--seed", type=int, default=0)
    add("--goodput", nargs="+", default=None, metavar="KEY:MS",
        help="SLOs, e.g. ttft:200 tpot:50 e2el:2000")
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
        help="send ignore_eos (default: on, the prompts are synthetic)")
    add("--temperature", type=float, default=0.0)
    add("--percentile-metrics", default="ttft,tpot,itl",
        help=f"comma-separated, of {','.join(PERCENTILE_METRICS)}")
    add("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    add("--num-warmups", type=int, default=0)
    add("--disable-tqdm", action="store_true")
    add("--save-result", action="store_true")
    add("--result-dir", default=None)
    add("--result-filename", default=None)
    add("--label", default=None, help="result filename prefix (default: the backend)")
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)")
    parser.set_defaults(func=main, bench_serve_flags=tuple(flags))
    return parser
