"""The router's added latency to the first SSE line, on any machine: an instant upstream (a
starlette/uvicorn stub answering /v1/completions with a few `data:` lines and `data: [DONE]`) and
`sluice router --worker STUB` (plain mode), each a subprocess on a free loopback port; one
client sends streamed requests with token-id prompts (`prompt: [ids...]`) of each length to the
stub directly and through the router, alternating, and prints the median time to the first SSE
line of each and the router's added ms (routed median minus direct median).

    python benchmarks/tools/router_overhead.py [--requests 40] [--lengths 1024 8192]
    python benchmarks/tools/router_overhead.py --sluice-root /tmp/older   # another tree's router

The client is stdlib http.client on one kept-alive connection per target, sequential (one
request in flight), so the difference between the two columns is the router's hop: reading the
body, the upstream request, and relaying the first event back. The machine's noise matters at
this scale (run it on an idle machine; the numbers are a few ms).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root

_STUB = r"""
import sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

def chunk(text, finish=None):
    return ("data: " + '{"id":"cmpl-stub","object":"text_completion","created":1700000000,'
            '"model":"stub","choices":[{"index":0,"text":"%s","logprobs":null,'
            '"finish_reason":%s}],"usage":null}' % (text, "null" if finish is None
                                                    else '"%s"' % finish) + "\n\n").encode()

EVENTS = [chunk(" a"), chunk(" b"), chunk(" c"), chunk("", "length"), b"data: [DONE]\n\n"]

async def completions(request):
    await request.body()
    async def events():
        for event in EVENTS:
            yield event
    return StreamingResponse(events(), media_type="text/event-stream")

async def health(request):
    return Response(status_code=200)

async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})

app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                        Route("/health", health), Route("/v1/models", models)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process on port {port} exited ({proc.returncode})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return
            conn.close()
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing healthy on port {port} after {timeout_s} s")


def first_line_ms(conn: http.client.HTTPConnection, body: bytes) -> float:
    """POST a streamed completion; ms until its first `data:` line, the rest read after."""
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body,
                 headers={"content-type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    while True:
        line = response.readline()
        if not line:
            raise RuntimeError("the stream ended before its first data: line")
        if line.startswith(b"data:"):
            elapsed = (time.perf_counter() - start) * 1000
            break
    response.read()  # the rest, so the connection is kept for the next request
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="per length and target")
    parser.add_argument("--warmup", type=int, default=5, help="per length and target, unmeasured")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192],
                        help="prompt lengths in token ids")
    parser.add_argument("--sluice-root", type=Path, default=ROOT,
                        help="the tree whose `sluice router` runs (default: this one)")
    ns = parser.parse_args()

    env = {**os.environ, "PYTHONPATH": str(ns.sluice_root.resolve())}
    stub_port, router_port = free_port(), free_port()
    stub = subprocess.Popen([sys.executable, "-c", _STUB, str(stub_port)], env=env)
    router = None
    try:
        wait_healthy(stub_port, stub)
        router = subprocess.Popen(
            [sys.executable, "-m", "sluice", "router", "--host", "127.0.0.1",
             "--port", str(router_port), "--worker", f"http://127.0.0.1:{stub_port}",
             "--log-level", "warning"], env=env, cwd=ns.sluice_root)
        wait_healthy(router_port, router)
        direct = http.client.HTTPConnection("127.0.0.1", stub_port, timeout=30)
        routed = http.client.HTTPConnection("127.0.0.1", router_port, timeout=30)
        print(f"router from {ns.sluice_root.resolve()}; {ns.requests} requests per length "
              f"and target (after {ns.warmup} unmeasured), medians in ms")
        print(f"{'tokens':>7} {'body KiB':>9} {'direct':>8} {'routed':>8} {'added':>8}")
        results = []
        for length in ns.lengths:
            body = json.dumps({"model": "stub", "prompt": [(7 * i + 11) % 150_000
                                                           for i in range(length)],
                               "max_tokens": 4, "stream": True}).encode()
            times: dict[str, list[float]] = {"direct": [], "routed": []}
            for i in range(ns.warmup + ns.requests):
                for name, conn in (("direct", direct), ("routed", routed)):
                    ms = first_line_ms(conn, body)
                    if i >= ns.warmup:
                        times[name].append(ms)
            d, r = statistics.median(times["direct"]), statistics.median(times["routed"])
            results.append({"tokens": length, "direct_ms": d, "routed_ms": r,
                            "added_ms": r - d})
            print(f"{length:>7} {len(body) / 1024:>9.1f} {d:>8.2f} {r:>8.2f} {r - d:>8.2f}")
        print(json.dumps(results))
    finally:
        for proc in (router, stub):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
