"""Where a PD request's time to first token goes, stage by stage, against a colocated instance.

Starts one colocated `sluice serve`, then a prefill, a decode and a router (`sluice.testing.
pd_cluster`, the layout `sluice bench pd` uses), each with SLUICE_STAGE_TRACE=1
(sluice/stage_trace.py), and sends the same fresh prompts to each, one at a time (streamed, two
output tokens). The marks of every process (their logs) and the client's are merged into one
timeline per request; the medians of its stages are printed and saved:

    python benchmarks/tools/pd_stage_trace.py --model DIR --device cuda --max-model-len 16384 \
        --prompt-lens 1024,8192 --repeats 3 --modes colocated,pd,pd-nohold \
        --output benchmarks/results/kv-transfer/DATE-pd-stage-trace-MACHINE.json

Modes: `colocated`; `pd` (defaults); `pd-nohold` (the prefill's bootstrap queue off:
bootstrap_wait_s 0). Stages, PD (ms from the client's send): `router_hop` (router has the request
-> the first API server has it), `decode_ask` (decode's blocks allocated -> its ask at the
prefill), `hold` (the prefill's engine has the request -> its prompt is scheduled: the bootstrap
queue), `compute` (the prompt's step), `send_plan` (the request finished -> its send at the
prefill's worker), `room_write` (the room's write began -> its status sent), `status_to_first`
(-> the decode took the first token), `first_to_client`; colocated: `client_to_api`,
`api_to_core`, `core_to_sched`, `compute`, `first_to_client`. Each mode's first request (the
first prompt length) is a warm-up, not counted. On a GPU shared by the two PD instances, run
it under MPS (see benchmarks/README.md)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

os.environ["SLUICE_STAGE_TRACE"] = "1"  # inherited by every instance started below

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from sluice.bench.record import make_record, write_record  # noqa: E402
from sluice.bench.serve import machine_line  # noqa: E402
from sluice.testing.pd_cluster import Instance, serve_argv, start_cluster, start_instances  # noqa: E402,E501
from sluice.testing.servers import free_port  # noqa: E402

Event = tuple[float, str, str, str]  # (unix time, process, event, detail)

_PD_STAGES = {  # name: (from (process, event), to (process, event)); process "*": any
    "router_hop": (("router", "router_in"), ("*", "api_in")),
    "decode_ask": (("decode0", "d_alloc"), ("prefill0", "p_ask")),
    "hold": (("prefill0", "core_add"), ("prefill0", "sched")),
    "compute": (("prefill0", "sched"), ("prefill0", "result")),
    "send_plan": (("prefill0", "finished"), ("prefill0", "p_add_send")),
    "room_write": (("prefill0", "p_room_start"), ("prefill0", "p_status")),
    "status_to_first": (("prefill0", "p_status"), ("decode0", "d_first")),
    "first_to_client": (("decode0", "d_first"), ("client", "client_first")),
}
_COLOCATED_STAGES = {
    "client_to_api": (("client", "client_send"), ("colocated", "api_in")),
    "api_to_core": (("colocated", "api_in"), ("colocated", "core_add")),
    "core_to_sched": (("colocated", "core_add"), ("colocated", "sched")),
    "compute": (("colocated", "sched"), ("colocated", "result")),
    "first_to_client": (("colocated", "result"), ("client", "client_first")),
}


def _drive(url: str, lengths: list[int], repeats: int, vocab: int, seed: int
           ) -> list[Event]:
    """One warm-up, then `repeats` fresh prompts per length; the client's marks."""
    rng = np.random.default_rng(seed)
    marks: list[Event] = []
    plan = [(lengths[0], True)] + [(n, False) for n in lengths for _ in range(repeats)]
    with httpx.Client(timeout=600) as client:
        for length, warmup in plan:
            prompt = rng.integers(10, vocab - 10, size=length).tolist()
            marks.append((time.time(), "client", "client_send", f"{length} {int(warmup)}"))
            with client.stream("POST", f"{url}/v1/completions", json={
                    "model": "bench", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as response:
                response.raise_for_status()
                seen = False
                for line in response.iter_lines():
                    if not seen and line.startswith("data:") and '"text"' in line:
                        marks.append((time.time(), "client", "client_first", ""))
                        seen = True
            time.sleep(0.3)  # the instances idle between prompts
    return marks


def _instance_marks(instances: list[Instance]) -> list[Event]:
    marks = []
    for instance in instances:
        for line in instance.log().splitlines():
            if line.startswith("STAGE "):
                _, when, _pid, event, *detail = line.split(" ")
                marks.append((float(when), instance.name, event, " ".join(detail).strip()))
    return marks


def _requests(marks: list[Event]) -> list[dict[str, Any]]:
    """The merged timeline cut at each client_send: per request, its length, whether it was
    the warm-up, and the first time of each (process, event) after its send (ms)."""
    requests: list[dict[str, Any]] = []
    for when, process, event, detail in sorted(marks):
        if event == "client_send":
            length, warmup = detail.split()
            requests.append({"prompt_tokens": int(length), "warmup": warmup == "1",
                             "t0": when, "first": {}})
        elif requests:
            first = requests[-1]["first"]
            if event == "finished" and detail != "True":
                continue  # the decode's end, not the prefill's
            first.setdefault((process, event), (when - requests[-1]["t0"]) * 1e3)
    return requests


def _stages(request: dict[str, Any], stages: dict[str, Any]) -> dict[str, float]:
    first = request["first"]

    def at(process: str, event: str) -> float | None:
        if process == "client" and event == "client_send":
            return 0.0
        if process == "*":
            times = [t for (p, e), t in first.items() if e == event]
            return min(times) if times else None
        return first.get((process, event))

    out = {}
    for name, (start, end) in stages.items():
        a, b = at(*start), at(*end)
        if a is not None and b is not None:
            out[name] = b - a
    if ("client", "client_first") in first:
        out["ttft"] = first[("client", "client_first")]
    return out


def summarize(marks: list[Event], colocated: bool) -> dict[str, dict[str, float]]:
    """Per prompt length: the median of each stage (ms) over the counted requests."""
    stages = _COLOCATED_STAGES if colocated else _PD_STAGES
    per_length: dict[int, list[dict[str, float]]] = {}
    for request in _requests(marks):
        if not request["warmup"]:
            per_length.setdefault(request["prompt_tokens"], []).append(
                _stages(request, stages))
    return {str(n): {k: statistics.median(r[k] for r in rows if k in r)
                     for k in [*stages, "ttft"] if any(k in r for r in rows)}
            for n, rows in per_length.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--prompt-lens", type=lambda t: [int(x) for x in t.split(",")],
                        default=[1024, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="colocated,pd,pd-nohold")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", default=None)
    ns = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/tools/pd_stage_trace.py", *(argv or sys.argv[1:])])
    print(command)
    print(machine_line())
    vocab = json.loads((Path(ns.model) / "config.json").read_text())["vocab_size"]
    flags = ["--device", ns.device, "--max-model-len", str(ns.max_model_len),
             "--served-model-name", "bench"]
    if ns.dtype:
        flags += ["--dtype", ns.dtype]
    gpu = ns.device != "cpu"
    result: dict[str, Any] = {"model": ns.model, "backend": ns.backend, "modes": {}}
    for mode in ns.modes.split(","):
        workdir = Path(tempfile.mkdtemp(prefix=f"sluice-stage-{mode}-"))
        if mode == "colocated":
            port = free_port()
            instance = Instance("colocated", serve_argv(
                ns.model, port, *flags,
                *(["--gpu-memory-utilization", "0.9"] if gpu else [])), port, workdir)
            start_instances([instance], 900)
            try:
                marks = _drive(instance.url, ns.prompt_lens, ns.repeats, vocab, ns.seed)
            finally:
                marks += _instance_marks([instance])
                instance.stop()
        elif mode in ("pd", "pd-nohold"):
            memory = ["--gpu-memory-utilization", "0.45"] if gpu else []
            cluster = start_cluster(
                ns.model, flags, ns.backend, workdir=workdir, one_at_a_time=True,
                prefill_flags=memory, decode_flags=memory, timeout_s=900,
                prefill_extra={"bootstrap_wait_s": 0} if mode == "pd-nohold" else None)
            try:
                marks = _drive(cluster.router.url, ns.prompt_lens, ns.repeats, vocab, ns.seed)
            finally:
                marks += _instance_marks([cluster.router, *cluster.prefills, *cluster.decodes])
                cluster.close()
        else:
            parser.error(f"unknown mode {mode!r} (colocated, pd, pd-nohold)")
        summary = summarize(marks, colocated=mode == "colocated")
        result["modes"][mode] = {"stages_ms": summary, "marks": marks}
        for length, stages in summary.items():
            print(f"{mode} {length} tokens: " + ", ".join(
                f"{name} {value:.2f}" for name, value in stages.items()) + " (ms, medians)",
                flush=True)
    if ns.output:
        write_record(ns.output, make_record("pd-stage-trace", result, device=ns.device,
                                            command=shlex.split(command)))
        print(f"results saved to {ns.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
