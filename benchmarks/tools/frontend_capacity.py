"""The OpenAI server's front end under load at GPU rates, on any machine: `sluice serve` with a
synthetic engine core (sluice/testing/synthetic_core.py: one token per running request every
--step-ms, no model) and `sluice bench serve` against it. Prints the benchmark's result block and
the server process's CPU seconds per streamed token.

    python benchmarks/tools/frontend_capacity.py --step-ms 5 -- --num-prompts 256 \\
        --random-input-len 562 --random-output-len 562 --random-range-ratio 0.82
    python benchmarks/tools/frontend_capacity.py --step-ms 2.5 -- --max-concurrency 32 ...

With --step-ms 5 and 256 requests the engine side offers 256 tokens per 5 ms (51k tok/s): a run
whose TPOT stays at the step time streamed every token as fast as the "engine" made it; a TPOT
above it means the front end (or the client: see its CPU line) fell behind. Everything after
`--` goes to `sluice bench serve` (its --port is set here). Linux only (the CPU time is read from
/proc).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]  # the repository root
sys.path.insert(0, str(ROOT))

from sluice.bench.record import read_results  # noqa: E402
from sluice.testing.servers import free_port  # noqa: E402
from sluice.testing.synthetic_core import MAX_SEQS_ENV, STEP_MS_ENV  # noqa: E402

# The server, with its engine core replaced by the synthetic one (the real launch path, sockets
# and wire protocol; only the spawned module differs).
_LAUNCHER = """
import sys
import sluice.engine.core_client as core_client
spawn = core_client.spawn_module
core_client.spawn_module = lambda module, startup: spawn("sluice.testing.synthetic_core", startup)
from sluice.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--model", default=None,
                        help="model folder for the tokenizer (default: the built-in tiny model)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args()
    bench_args = [a for a in ns.bench_args if a != "--"]
    if ns.step_ms <= 0 or ns.max_num_seqs < 1:
        raise SystemExit("--step-ms must be > 0 and --max-num-seqs >= 1")
    port = free_port()
    env = dict(os.environ, **{STEP_MS_ENV: str(ns.step_ms), MAX_SEQS_ENV: str(ns.max_num_seqs)})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-c", _LAUNCHER, "serve", "--port", str(port), "--disable-log-stats",
            "--uvicorn-log-level", "warning"]
    if ns.model:
        argv += ["--model", ns.model]
    workdir = Path(tempfile.mkdtemp(prefix="sluice-frontend-capacity-"))
    with open(workdir / "server.log", "wb") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print((workdir / "server.log").read_text()[-3000:], file=sys.stderr)
                return 1
            time.sleep(0.5)
        before = cpu_seconds(server.pid)
        result = workdir / "result.json"
        bench = subprocess.run(
            [sys.executable, "-m", "sluice", "bench", "serve", "--port", str(port),
             "--disable-tqdm", "--save-result", "--result-dir", str(workdir),
             "--result-filename", result.name, *bench_args], env=env)
        used = cpu_seconds(server.pid) - before
        if bench.returncode != 0 or not result.exists():
            return bench.returncode or 1
        tokens = read_results(result)["total_output_tokens"]
        print(f"synthetic engine: a token per running request every {ns.step_ms:g} ms, at most "
              f"{ns.max_num_seqs} requests")
        print(f"server process CPU: {used:.2f} s over the run, {1e6 * used / tokens:.1f} us "
              f"per streamed token ({tokens} tokens)")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
