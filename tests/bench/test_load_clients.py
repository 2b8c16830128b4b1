"""Requests split over client processes (load_clients.py): each request comes back at its own
index, sent at its own offset from the one common start, with each process's share of the
concurrency; and `sluice bench serve --num-clients 2` reports failures and the clients' CPU
utilisation. Against the scripted SSE server (sse_server.py), real processes on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.bench.load_clients import (
    ClientsRun,
    concurrency_shares,
    request_owners,
    run_in_process,
    run_in_processes,
)
from sluice.bench.openai_client import RequestInput
from sluice.bench.serve import client_cpu_lines
from sluice.testing.sse_server import (
    STREAM_HEAD,
    Handler,
    HTTPRequest,
    Reply,
    SSEServer,
    chunk,
    completion_chunk,
    json_reply,
    openai_handler,
    sse,
)

pytestmark = pytest.mark.serial


def test_concurrency_is_split_as_evenly_as_can_be() -> None:
    assert concurrency_shares(5, 2) == [3, 2]
    assert concurrency_shares(32, 4) == [8, 8, 8, 8]
    assert concurrency_shares(7, 7) == [1] * 7
    assert concurrency_shares(None, 3) == [None, None, None]
    with pytest.raises(ValueError, match=r"--num-clients \(3\) must be <= --max-concurrency "
                                         r"\(2\)"):
        concurrency_shares(2, 3)
    with pytest.raises(ValueError, match="--num-clients must be >= 1, got 0"):
        concurrency_shares(None, 0)


def test_requests_go_to_the_owner_of_their_slot() -> None:
    # Slots 0-2 are client 0's, 3-4 client 1's: the first 5 requests start together.
    assert request_owners(12, [3, 2]) == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0]
    assert request_owners(5, [None, None]) == [0, 1, 0, 1, 0]
    owners = request_owners(64, [6, 5, 5])
    assert [owners.count(i) for i in range(3)] == [24, 20, 20]


def test_the_self_check_warns_when_a_client_was_busy_the_whole_run() -> None:
    def lines(util: list[float], wait: list[float] | None) -> list[str]:
        return client_cpu_lines(ClientsRun([], 1.0, util, wait, "uvloop"))

    quiet = lines([0.3, 0.5], [0.1, 0.0])
    assert quiet == [f"{'Client processes:':<40} {2:<10} (uvloop)",
                     f"{'Client CPU util (max / mean):':<40} 0.50 / 0.40",
                     f"{'Client CPU wait (max / mean):':<40} 0.10 / 0.05"]
    assert lines([0.97], None)[-1].startswith("warning: a client process was busy")
    # Half running, half waiting for a CPU: as much the limit as a saturated one.
    assert lines([0.5, 0.2], [0.45, 0.1])[-1].startswith("warning: a client process was busy")


def inputs(url: str, output_lens: list[int]) -> list[RequestInput]:
    return [RequestInput(api_url=url + "/v1/completions", model="fake", prompt=f"request {j}",
                         prompt_len=2, output_len=n, ignore_eos=True, temperature=None,
                         chat=False) for j, n in enumerate(output_lens)]


def test_client_processes_return_each_request_at_its_index_and_offset() -> None:
    output_lens = [3, 9, 1, 6, 12, 2, 7, 4, 10]
    offsets = [0.0, 0.0, 0.05, 0.1, 0.1, 0.2, 0.3, 0.3, 0.4]
    done = []
    with SSEServer(openai_handler()) as server:
        run = asyncio.run(run_in_processes(inputs(server.url, output_lens), offsets,
                                           max_concurrency=None, num_clients=3, api_key="k",
                                           num_warmups=2, on_done=lambda: done.append(1)))
        one = asyncio.run(run_in_process(inputs(server.url, output_lens), offsets, None, "k", 0))
    assert len(done) == len(output_lens)
    for run_ in (run, one):
        assert [t.output_tokens for t in run_.timings] == output_lens
        assert [len(t.itl) + 1 for t in run_.timings] == output_lens
        assert all(t.success and t.generated_text == " tok" * n
                   for t, n in zip(run_.timings, output_lens))
        # Sent at the offset from the one start (met within a generous 250 ms on a busy machine).
        for t, offset in zip(run_.timings, offsets):
            assert offset <= t.start_time < offset + 0.25, (t.start_time, offset)
        assert run_.duration_s >= max(t.start_time + t.latency for t in run_.timings)
    assert len(run.cpu_util) == 3 and len(one.cpu_util) == 1
    assert all(0 < u < 2 for u in run.cpu_util + one.cpu_util)
    # 2 warm-ups (one per client of the first two) + the run, each a request of the server.
    posted = [r for r in server.requests if r.method == "POST"]
    assert len(posted) == 2 * len(output_lens) + 2
    assert {r.headers["authorization"] for r in posted} == {"Bearer k"}


def test_each_client_keeps_to_its_share_of_the_concurrency() -> None:
    # Each answer trickles out over ~50 ms, so requests overlap as far as the limit lets them.
    reply = Reply([STREAM_HEAD, chunk(sse(completion_chunk("x"))), chunk(sse("[DONE]")),
                   b"0\r\n\r\n"], gap_s=0.025)
    with SSEServer(lambda request: reply) as server:
        run = asyncio.run(run_in_processes(inputs(server.url, [1] * 12), [0.0] * 12,
                                           max_concurrency=3, num_clients=2, api_key=None,
                                           num_warmups=0))
    assert all(t.success for t in run.timings)
    # Shares 2 + 1: three requests in flight at once, never more.
    intervals = [(t.start_time, t.start_time + t.latency) for t in run.timings]
    most = max(sum(1 for s, e in intervals if s <= start < e) for start, _ in intervals)
    assert most == 3


def failing_half() -> Handler:
    """Of the completions, in arrival order: an HTTP 503, an error event, two good ones, ..."""
    counter = itertools.count()
    good = openai_handler()

    def handle(request: HTTPRequest) -> Reply:
        if request.method == "GET":
            return good(request)
        n = next(counter)
        if n % 4 == 0:
            return json_reply(503, {"error": {"message": "overloaded"}})
        if n % 4 == 1:
            events = [sse(completion_chunk("a")), sse({"error": {"message": "engine died"}})]
            return Reply([STREAM_HEAD + b"".join(chunk(e) for e in events) + b"0\r\n\r\n"])
        return good(request)

    return handle


def test_bench_serve_with_two_clients_reports_failures_and_cpu_util(tmp_path: Path) -> None:
    with SSEServer(failing_half()) as server:
        out = subprocess.run(
            [sys.executable, "-m", "sluice", "bench", "serve", "--base-url", server.url,
             "--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "16",
             "--num-clients", "2", "--max-concurrency", "4", "--disable-tqdm", "--save-result",
             "--result-dir", str(tmp_path), "--result-filename", "r.json"],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == "serve"
    result = record["results"]
    assert (result["completed"], result["failed"]) == (4, 4)
    errors = sorted(e.split(":")[0] for e in result["errors"] if e)
    assert errors == ["HTTP 503"] * 2 + ["error event"] * 2
    assert result["total_output_tokens"] == 4 * 16
    assert result["num_clients"] == 2 and result["max_concurrent_requests"] <= 4
    cpu = result["client_cpu_util"]
    assert len(cpu["per_process"]) == 2 and all(0 < u < 2 for u in cpu["per_process"])
    assert cpu["max"] == max(cpu["per_process"])
    assert cpu["mean"] == pytest.approx(sum(cpu["per_process"]) / 2)
    assert result["client_event_loop"] in ("asyncio", "uvloop")
    if sys.platform == "linux":  # run-queue wait from /proc/thread-self/schedstat
        wait = result["client_cpu_wait"]
        assert len(wait["per_process"]) == 2 and all(0 <= w < 2 for w in wait["per_process"])
    lines = out.stdout.splitlines()
    assert any(line.startswith("Client processes:") and " 2 " in line for line in lines)
    assert any(line.startswith("Client CPU util (max / mean):") for line in lines)
    assert "Failed requests (4; the first 10):" in lines


def test_more_clients_than_concurrency_is_refused(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "serve", "--base-url", "http://127.0.0.1:9",
         "--model", "fake", "--num-prompts", "8", "--num-clients", "3", "--max-concurrency",
         "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--num-clients (3) must be <= --max-concurrency (2)" in out.stderr
