"""`sluice bench pd`: prefill/decode disaggregation against one colocated instance, at the same
load, on the same machine (issue 16's GPU measurements).

    sluice bench pd --model Qwen/Qwen3-8B --device cuda --backend mooncake \\
        --workload 1024:256 --workload 8192:256 --request-rates 1,2,4,8 --num-prompts 200 \\
        --goodput ttft:2000 tpot:50 --transfer-prompt-lens 8192,32768 \\
        --output benchmarks/results/kv-transfer/DATE-pd-h200.json

Phase 1 starts one colocated `sluice serve` (`--colocated-memory` of the GPU) and loads it with
`sluice bench serve` for every workload (INPUT:OUTPUT tokens, random prompts) and request
rate. Phase 2 starts a prefill and a decode instance on the same device, one after the other
(`--prefill-memory` and `--decode-memory`: the memory split) and a `sluice router`, and runs
the same loads through the router; then, for each of `--transfer-prompt-lens`, it sends
`--transfer-repeats` single fresh prompts (one output token) and reads the prefill's transfer
counters: KV bytes, seconds spent writing, hence the transfer bandwidth, and the seconds of the
room's write after the prompt's last step (exposed: the layer writes during the prompt overlap
its compute) as a share of the TTFT seen by the client (the same prompts go to the colocated
instance first, one at a time: PD's TTFT against colocated's at no load). It prints TTFT,
TPOT and ITL (mean and P99) and goodput for both and their ratio (PD / colocated), and saves
everything as JSON with the command and the machine. `--prefill-config` adds PDConnector
settings to the prefill instance (an A/B of `bootstrap_wait_s`, for one).

Two GPUs of one host: `--prefill-device cuda:0 --decode-device cuda:1` (run it with both GPUs
in CUDA_VISIBLE_DEVICES; the colocated instance stays on `--device`), and memory 0.9 each.

On a CPU with a tiny model it is a smoke test of the whole path (`--device cpu`, small loads):
    sluice bench pd --model PATH --device cpu --backend fake --workload 64:16 \\
        --request-rates inf --num-prompts 8 --transfer-prompt-lens 256 --dtype float32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from sluice.bench.serve import ServeBenchConfig, machine_line, model_tokenizer, run_benchmark
from sluice.bench.serve_metrics import parse_goodput
from sluice.testing.pd_cluster import Instance, serve_argv, start_cluster, start_instances
from sluice.testing.servers import free_port

_METRICS = ("ttft", "tpot", "itl")


def _workload(text: str) -> tuple[int, int]:
    try:
        input_len, output_len = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a workload is INPUT:OUTPUT tokens, got {text!r}"
                                         ) from None
    return input_len, output_len


def _config(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--prefill-config must be a JSON object, got {text!r}")
    return value


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _load(base_url: str, model: str, input_len: int, output_len: int, rate: float,
          ns: argparse.Namespace) -> dict[str, Any]:
    config = ServeBenchConfig(
        base_url=base_url, endpoint="/v1/completions", model=model, tokenizer=model_tokenizer(ns),
        dataset_name="random", num_prompts=ns.num_prompts, random_input_len=input_len,
        random_output_len=output_len, random_range_ratio=0.0, shared_prefix_len=0,
        shared_prefix_groups=1, request_rate=rate, burstiness=1.0,
        max_concurrency=ns.max_concurrency, seed=ns.seed,
        goodput=parse_goodput(ns.goodput or []), ignore_eos=True, temperature=0.0,
        percentile_metrics=_METRICS, metric_percentiles=(99.0,), num_warmups=ns.num_warmups,
        disable_tqdm=True, api_key=None)
    return asyncio.run(run_benchmark(config))


def _summary(result: dict[str, Any]) -> dict[str, float]:
    keys = [f"{stat}_{metric}_ms" for metric in _METRICS for stat in ("mean", "p99")]
    out = {key: result.get(key, math.nan) for key in keys}
    out["completed"] = result.get("completed", 0)
    out["goodput"] = result.get("request_goodput", math.nan)
    out["output_throughput"] = result.get("output_throughput", math.nan)
    return out


def _loads(base_url: str, model: str, ns: argparse.Namespace) -> dict[str, Any]:
    results = {}
    for input_len, output_len in ns.workload:
        for rate in ns.request_rates:
            key = f"{input_len}:{output_len}@{rate}"
            print(f"--- {key} on {base_url}", flush=True)
            results[key] = _summary(_load(base_url, model, input_len, output_len, rate, ns))
    return results


def _prefill_counters(prefill: Instance) -> dict[str, float]:
    # (Generous: under a long transfer the prefill's engine answers late.)
    return prefill.engine_info(timeout_s=120.0)["scheduler"]["kv_connector"]


def _transfer(router: Instance, prefill: Instance | None, model: str, vocab: int,
              ns: argparse.Namespace) -> dict[str, Any]:
    """Per prompt length: TTFT at the client, KV bytes and write seconds at the prefill; with
    no prefill (the colocated instance), the TTFT alone, of the same prompts (fresh there)."""
    rng = np.random.default_rng(ns.seed + 1)
    out: dict[str, Any] = {}
    with httpx.Client(timeout=600) as client:
        for length in ns.transfer_prompt_lens:
            rows = []
            for _ in range(ns.transfer_repeats):
                prompt = rng.integers(10, vocab - 10, size=length).tolist()  # fresh: no hit
                before = _prefill_counters(prefill) if prefill is not None else {}
                started = time.perf_counter()
                ttft = None
                with client.stream("POST", f"{router.url}/v1/completions", json={
                        "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                        "ignore_eos": True, "stream": True}) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if ttft is None and line.startswith("data:") and '"text"' in line:
                            ttft = time.perf_counter() - started
                if prefill is None:
                    rows.append({"ttft_s": ttft})
                    continue
                time.sleep(0.2)  # the prefill's counters arrive with its next step
                after = _prefill_counters(prefill)
                # The room's write, after the prompt's last step (exposed: on the path to
                # the first token), and, layer-wise, the writes during the prompt's steps
                # (they overlap its compute).
                delta = {k: after.get(k, 0) - before.get(k, 0) for k in (
                    "worker_sent_bytes", "worker_layer_sent_bytes", "worker_transfer_seconds",
                    "worker_layer_transfer_seconds")}
                sent = delta["worker_sent_bytes"] + delta["worker_layer_sent_bytes"]
                exposed = delta["worker_transfer_seconds"]
                seconds = exposed + delta["worker_layer_transfer_seconds"]
                rows.append({"ttft_s": ttft, "kv_bytes": sent, "transfer_s": seconds,
                             "exposed_transfer_s": exposed,
                             "gb_per_s": sent / seconds / 1e9 if seconds else math.nan,
                             "share_of_ttft": exposed / ttft if ttft else math.nan,
                             "overlapped_share_of_ttft": (seconds - exposed) / ttft
                             if ttft else math.nan})
            out[str(length)] = {"runs": rows, **{
                key: float(np.median([r[key] for r in rows])) for key in rows[0]}}
            median = out[str(length)]
            if prefill is None:
                print(f"colocated {length} tokens: TTFT {median['ttft_s'] * 1e3:.1f} ms "
                      f"(single fresh prompts)", flush=True)
                continue
            print(f"transfer {length} tokens: {median['kv_bytes'] / 2**20:.1f} MiB in "
                  f"{median['transfer_s'] * 1e3:.1f} ms ({median['gb_per_s']:.2f} GB/s); "
                  f"exposed {median['exposed_transfer_s'] * 1e3:.2f} ms, "
                  f"{100 * median['share_of_ttft']:.1f}% of TTFT {median['ttft_s'] * 1e3:.0f} ms "
                  f"(layer writes during the prompt: "
                  f"{100 * median['overlapped_share_of_ttft']:.1f}%)", flush=True)
    return out


def _table(colocated: dict[str, Any], pd: dict[str, Any]) -> str:
    lines = [f"{'load':<18}{'metric':<16}{'colocated':>12}{'PD':>12}{'PD/coloc':>10}"]
    for key in colocated:
        for metric in [*(f"{s}_{m}_ms" for m in _METRICS for s in ("mean", "p99")),
                       "goodput", "output_throughput"]:
            a, b = colocated[key].get(metric, math.nan), pd.get(key, {}).get(metric, math.nan)
            ratio = b / a if a and not math.isnan(a) else math.nan
            lines.append(f"{key:<18}{metric:<16}{a:>12.2f}{b:>12.2f}{ratio:>10.2f}")
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    command = shlex.join(["sluice", "bench", "pd", *sys.argv[3:]]) if len(sys.argv) > 3 else \
        "sluice bench pd"
    print(command)
    print(machine_line())
    engine_flags = ["--device", ns.device, "--max-model-len", str(ns.max_model_len),
                    "--served-model-name", "bench", *shlex.split(ns.engine_args or "")]
    if ns.dtype:
        engine_flags += ["--dtype", ns.dtype]
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-pd-"))
    result: dict[str, Any] = {"model": ns.model, "backend": ns.backend,
                              "prefill_device": ns.prefill_device or ns.device,
                              "decode_device": ns.decode_device or ns.device}

    port = free_port()
    colocated = Instance("colocated", serve_argv(
        ns.model, port, *engine_flags, "--gpu-memory-utilization", str(ns.colocated_memory)),
        port, workdir)
    start_instances([colocated], ns.start_timeout)
    try:
        result["colocated"] = _loads(colocated.url, "bench", ns)
        if ns.transfer_prompt_lens:
            from sluice.model.hf_config import load_hf_config

            result["colocated_single"] = _transfer(
                colocated, None, "bench", load_hf_config(ns.model).vocab_size, ns)
    finally:
        colocated.stop()

    prefill_extra = {"mooncake_protocol": ns.mooncake_protocol} if ns.backend == "mooncake" \
        else {}
    decode_extra = dict(prefill_extra)
    prefill_extra.update(ns.prefill_config)
    cluster = start_cluster(
        ns.model, engine_flags, ns.backend, workdir=workdir, one_at_a_time=True,
        prefill_flags=["--gpu-memory-utilization", str(ns.prefill_memory),
                       "--device", ns.prefill_device or ns.device],
        decode_flags=["--gpu-memory-utilization", str(ns.decode_memory),
                      "--device", ns.decode_device or ns.device],
        prefill_extra=prefill_extra, decode_extra=decode_extra,
        timeout_s=ns.start_timeout)
    try:
        result["pd"] = _loads(cluster.router.url, "bench", ns)
        from sluice.model.hf_config import load_hf_config

        vocab = load_hf_config(ns.model).vocab_size
        result["transfer"] = _transfer(cluster.router, cluster.prefills[0], "bench", vocab, ns)
        result["prefill_counters"] = _prefill_counters(cluster.prefills[0])
        result["decode_counters"] = cluster.decodes[0].engine_info()["scheduler"]["kv_connector"]
    finally:
        cluster.close()
    print(_table(result["colocated"], result["pd"]))
    for length, row in result.get("transfer", {}).items():
        alone = result.get("colocated_single", {}).get(length)
        if alone:  # the same prompts, one at a time: PD's cost at no load
            print(f"single fresh {length}-token prompts: TTFT PD {row['ttft_s'] * 1e3:.1f} ms, "
                  f"colocated {alone['ttft_s'] * 1e3:.1f} ms "
                  f"({row['ttft_s'] / alone['ttft_s']:.2f}x)")
    if ns.output:
        from sluice.bench.record import make_record, write_record

        write_record(ns.output, make_record("pd", result, device=ns.device,
                                            command=shlex.split(command)))
        print(f"results saved to {ns.output}")
    failed = [k for k, v in {**result["colocated"], **result["pd"]}.items()
              if v["completed"] < ns.num_prompts]
    return 1 if failed else 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("pd", help="prefill/decode disaggregation vs colocated",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder or hub id")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prefill-device", default=None,
                        help="the prefill instance's device (default: --device), e.g. cuda:0")
    parser.add_argument("--decode-device", default=None,
                        help="the decode instance's device (default: --device), e.g. cuda:1")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=34816)
    parser.add_argument("--engine-args", default="", help="more `sluice serve` flags, quoted")
    parser.add_argument("--backend", default="mooncake",
                        choices=("mooncake", "shm", "auto", "fake"))
    parser.add_argument("--mooncake-protocol", default="tcp", help="tcp | rdma")
    parser.add_argument("--prefill-config", type=_config, default={},
                        help="more PDConnector settings of the prefill instance, a JSON "
                             "object (e.g. '{\"bootstrap_wait_s\": 0}')")
    parser.add_argument("--colocated-memory", type=float, default=0.9)
    parser.add_argument("--prefill-memory", type=float, default=0.45)
    parser.add_argument("--decode-memory", type=float, default=0.45,
                        help="fraction of the GPU for the decode instance (it starts second)")
    parser.add_argument("--workload", type=_workload, action="append", default=None,
                        metavar="IN:OUT", help="input:output tokens (repeat; default 1024:256 "
                                               "and 8192:256)")
    parser.add_argument("--request-rates", type=_rates, default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--num-warmups", type=int, default=2)
    parser.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:50"],
                        metavar="KEY:MS")
    parser.add_argument("--transfer-prompt-lens", type=lambda t: [int(x) for x in t.split(",")],
                        default=[8192, 32768])
    parser.add_argument("--transfer-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--output", default=None, help="JSON file for the results")
    parser.set_defaults(func=_main_with_defaults)
    return parser


def _main_with_defaults(ns: argparse.Namespace) -> int:
    if ns.workload is None:
        ns.workload = [(1024, 256), (8192, 256)]
    return main(ns)
