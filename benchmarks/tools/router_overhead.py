"""The router's added latency to the first SSE line, on any machine: an instant upstream (a
starlette/uvicorn stub answering /v1/completions with a few `data:` lines and `data: [DONE]`) and
`sluice router --worker STUB` (plain mode), each a subprocess on a free loopback port; one
client sends streamed requests with token-id prompts (`prompt: [ids...]`) of each length to the
stub directly and through the router, alternating, and prints the median time to the first SSE
line of each and the router's added ms (routed median minus direct median).

    python benchmarks/tools/router_overhead.py [--requests 40] [--lengths 1024 8192]
    git archive REV sluice | tar -x -C /tmp/old      # another tree's router beside this one's:
    python benchmarks/tools/router_overhead.py --baseline-root /tmp/old

The client is stdlib http.client on one kept-alive connection per target, sequential (one
request in flight), so the difference between the columns is the router's hop: reading the
body, the upstream request, and relaying the first event back. With --baseline-root a second
router (that tree's code, same venv) runs beside this tree's over the same stub, the requests
to the stub and the routers taken in turn, so the machine's drift (a few tenths of a ms on a
small VM, about the size of the differences measured) falls on every column alike.
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
    parser.add_argument("--baseline-root", type=Path, default=None,
                        help="another tree whose router runs beside it, measured in turn")
    ns = parser.parse_args()

    trees = {"routed": ns.sluice_root.resolve()}
    if ns.baseline_root is not None:
        trees = {"baseline": ns.baseline_root.resolve(), **trees}
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, "-c", _STUB, str(stub_port)],
                            env={**os.environ, "PYTHONPATH": str(trees["routed"])})
    routers: list[subprocess.Popen] = []
    try:
        wait_healthy(stub_port, stub)
        conns = {"direct": http.client.HTTPConnection("127.0.0.1", stub_port, timeout=30)}
        for name, tree in trees.items():
            port = free_port()
            routers.append(subprocess.Popen(
                [sys.executable, "-m", "sluice", "router", "--host", "127.0.0.1",
                 "--port", str(port), "--worker", f"http://127.0.0.1:{stub_port}",
                 "--log-level", "warning"], env={**os.environ, "PYTHONPATH": str(tree)},
                cwd=tree))
            wait_healthy(port, routers[-1])
            conns[name] = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            print(f"{name}: the router of {tree}")
        print(f"{ns.requests} requests per length and target (after {ns.warmup} unmeasured), "
              f"medians in ms; added: the router's median minus direct's")
        names = list(conns)
        print(f"{'tokens':>7} {'body KiB':>9}" + "".join(f" {n:>9}" for n in names)
              + "".join(f" {'+' + n:>9}" for n in names[1:]))
        results = []
        for length in ns.lengths:
            body = json.dumps({"model": "stub", "prompt": [(7 * i + 11) % 150_000
                                                           for i in range(length)],
                               "max_tokens": 4, "stream": True}).encode()
            times: dict[str, list[float]] = {name: [] for name in names}
            for i in range(ns.warmup + ns.requests):
                for name, conn in conns.items():
                    ms = first_line_ms(conn, body)
                    if i >= ns.warmup:
                        times[name].append(ms)
            medians = {name: statistics.median(t) for name, t in times.items()}
            row: dict[str, float] = {"tokens": length}
            for name in names:
                row[f"{name}_ms"] = medians[name]
            for name in names[1:]:
                row[f"{name}_added_ms"] = medians[name] - medians["direct"]
            results.append(row)
            print(f"{length:>7} {len(body) / 1024:>9.1f}"
                  + "".join(f" {medians[n]:>9.2f}" for n in names)
                  + "".join(f" {medians[n] - medians['direct']:>9.2f}" for n in names[1:]))
        print(json.dumps(results))
    finally:
        for proc in (*routers, stub):
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
