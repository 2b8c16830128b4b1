"""How many server-sent events one load-generator process can take: the client of
`sluice bench serve` (http_stream.py + msgspec) against the httpx client it replaced
(`aiter_lines` + `json.loads` per event, kept here as the baseline), in the same run.

    python -m sluice.bench.client_speed                  # against a fake server it starts
    python -m sluice.bench.client_speed --base-url URL   # against a running server

The fake server (sluice/testing/sse_server.py, its own process) streams pre-built OpenAI chunks
as fast as its socket takes them, `--events-per-write` chunks a write (1: each event its own
write, as uvicorn sends them; more: what a client that falls behind reads anyway), so the client
process is the limit: its events/s is its ceiling when its CPU util is near 1. On a host short
of cores the fake server, the client and anything else share them; the CPU wait column says how
long the client waited for one. Against a real server the events/s is the server's; the client's
CPU time per event is then the comparable figure. Each client runs `--repeats` times,
alternating, and the best run is reported, on each event loop of `--loops` (the replaced client
ran on asyncio's own loop; `sluice bench serve` now takes uvloop when it is installed).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sluice.bench.http_stream import ConnectionPool
from sluice.bench.load_clients import run_queue_wait_s
from sluice.bench.openai_client import RequestInput, build_payload, prepare, send_request
from sluice.bench.serve import machine_line
from sluice.bench.serve_metrics import RequestTiming


async def _send_httpx(client: Any, request: RequestInput) -> RequestTiming:
    """The replaced client's hot path: httpx streaming, one json.loads per event."""
    timing = RequestTiming(prompt_len=request.prompt_len)
    start = last = time.perf_counter()
    received_token = False
    async with client.stream("POST", request.api_url, json=build_payload(request)) as resp:
        if resp.status_code != 200:
            timing.error = f"HTTP {resp.status_code}"
            return timing
        texts = []
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if choices := event.get("choices"):
                choice = choices[0]
                if request.chat:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    is_token = bool(text) or not (choice.get("finish_reason") or "role" in delta)
                else:
                    text = choice.get("text") or ""
                    is_token = bool(text) or choice.get("finish_reason") is None
                texts.append(text)
                if is_token:
                    if received_token:
                        timing.itl.append(now - last)
                    else:
                        timing.ttft, received_token = now - start, True
                    last = now
            if usage := event.get("usage"):
                timing.output_tokens = int(usage.get("completion_tokens") or 0)
        timing.generated_text = "".join(texts)
    timing.success, timing.latency = received_token, last - start
    return timing


async def _run(send: Callable[[RequestInput], Awaitable[RequestTiming]],
               requests: list[RequestInput], concurrency: int) -> dict[str, float]:
    limit = asyncio.Semaphore(concurrency)

    async def one(request: RequestInput) -> RequestTiming:
        async with limit:
            return await send(request)

    cpu0, wait0, t0 = time.process_time(), run_queue_wait_s(), time.perf_counter()
    timings = await asyncio.gather(*[one(r) for r in requests])
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    wait1 = run_queue_wait_s()
    failed = [t.error for t in timings if not t.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0]}")
    events = sum(len(t.itl) + 1 for t in timings)
    return {"events": events, "wall_s": wall, "cpu_s": cpu, "events_per_s": events / wall,
            "cpu_us_per_event": cpu / events * 1e6, "cpu_util": cpu / wall,
            # Runnable but waiting for a CPU (Linux): the host was short of cores.
            "cpu_wait": math.nan if wait0 is None or wait1 is None else (wait1 - wait0) / wall}


async def _measure(client: str, requests: list[RequestInput],
                   concurrency: int) -> dict[str, float]:
    if client == "sluice":
        pool = ConnectionPool()
        prepared = {id(r): prepare(r, None) for r in requests}
        try:
            return await _run(lambda r: send_request(pool, prepared[id(r)]), requests,
                              concurrency)
        finally:
            pool.close()
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
        return await _run(lambda r: _send_httpx(http, r), requests, concurrency)


def _start_fake_server(events_per_write: int,
                       step_ms: float | None = None) -> tuple[subprocess.Popen, str]:
    step = [] if step_ms is None else ["--step-ms", str(step_ms)]
    proc = subprocess.Popen([sys.executable, "-m", "sluice.testing.sse_server",
                             "--events-per-write", str(events_per_write), *step],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url:
        proc.kill()
        raise RuntimeError("the fake SSE server did not start")
    return proc, url


def _run_on(loop: str, main: Awaitable[dict[str, float]]) -> dict[str, float]:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)  # type: ignore[arg-type]
    return asyncio.run(main)  # type: ignore[arg-type]


def measure(base_url: str, loop: str, ns: argparse.Namespace) -> dict[str, Any]:
    requests = [RequestInput(api_url=base_url + ns.endpoint, model=ns.model, prompt="hi " * 8,
                             prompt_len=8, output_len=ns.output_len, ignore_eos=True,
                             temperature=0.0, chat=ns.endpoint.endswith("chat/completions"))
                for _ in range(ns.num_requests)]
    runs: dict[str, list[dict[str, float]]] = {"httpx": [], "sluice": []}
    for _ in range(ns.repeats):
        for client in runs:
            runs[client].append(_run_on(loop, _measure(client, requests, ns.concurrency)))
    best = {client: max(r, key=lambda run: run["events_per_s"]) for client, r in runs.items()}
    return {"best": best, "runs": runs,
            "speedup_events_per_s": best["sluice"]["events_per_s"] / best["httpx"]["events_per_s"],
            "cpu_per_event_ratio": best["httpx"]["cpu_us_per_event"]
            / best["sluice"]["cpu_us_per_event"]}


def _table(label: str, result: dict[str, Any]) -> str:
    lines = [f"{label}",
             f"  {'client':<8}{'events/s':>12}{'CPU us/event':>14}{'CPU util':>10}"
             f"{'CPU wait':>10}{'events':>9}"]
    for client, r in result["best"].items():
        lines.append(f"  {client:<8}{r['events_per_s']:>12,.0f}{r['cpu_us_per_event']:>14.1f}"
                     f"{r['cpu_util']:>10.2f}{r['cpu_wait']:>10.2f}{r['events']:>9}")
    lines.append(f"  sluice / httpx: {result['speedup_events_per_s']:.2f}x events/s, "
                 f"{result['cpu_per_event_ratio']:.2f}x less CPU per event")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None,
                        help="a running server (default: start the fake SSE server)")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default="fake")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--events-per-write", default="1,8",
                        help="fake server only: comma-separated, one measurement each")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="fake server only: every stream's next event once a step of this "
                             "period (an engine's decode steps; offered events/s = concurrency "
                             "/ step), instead of as fast as it can")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loops", default=None,
                        help="event loops, comma-separated (default: asyncio, and uvloop when "
                             "installed)")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    ns = parser.parse_args()
    loops = ns.loops.split(",") if ns.loops else ["asyncio"] + (
        ["uvloop"] if importlib.util.find_spec("uvloop") else [])
    print(" ".join(["python -m sluice.bench.client_speed", *sys.argv[1:]]))
    print(machine_line())
    results: dict[str, Any] = {}
    for loop in loops:
        if ns.base_url:
            results[f"server_{loop}"] = result = measure(ns.base_url.rstrip("/"), loop, ns)
            print(_table(f"server {ns.base_url}, {loop} loop", result))
            continue
        for events_per_write in (int(n) for n in ns.events_per_write.split(",")):
            proc, url = _start_fake_server(events_per_write, ns.step_ms)
            try:
                result = measure(url, loop, ns)
            finally:
                proc.terminate()
                proc.wait()
            pacing = ("" if ns.step_ms is None else
                      f", one event per stream every {ns.step_ms:g} ms (offered "
                      f"{ns.concurrency / ns.step_ms * 1000:,.0f} events/s)")
            results[f"fake_{events_per_write}_per_write_{loop}"] = result
            print(_table(f"fake server, {events_per_write} event(s) per write{pacing}, "
                         f"{loop} loop", result))
    if ns.output:
        from sluice.bench.record import make_record, write_record

        write_record(ns.output, make_record("client-speed", results))


if __name__ == "__main__":
    main()
