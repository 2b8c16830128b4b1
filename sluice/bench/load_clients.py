"""The load generator's client processes: one run's requests sent from this process, or split
over N processes so the client is not the limit (`sluice bench serve --num-clients N`).

Lifecycle of N > 1 client processes (each `python -m sluice.bench.load_clients`):
    parent -> ClientJob     its requests (prompts drawn by the parent), arrival offsets, its
                            share of --max-concurrency, its share of the warm-ups
    client -> ClientReady   warm-ups done, requests encoded; its perf_counter() now
    parent -> ClientStart   the common start t0 on the perf_counter clock (a little ahead)
    client -> ClientProgress per finished request (for the progress bar)
    client -> ClientResult  its RequestTimings (start times relative to t0), when its last request
                            finished, its CPU and run-queue seconds over [t0, that end]
Messages are msgspec JSON, one a line: parent -> client on stdin, client -> parent on stdout (the
client moves its own stdout to stderr, so a stray print cannot break a message).

`time.perf_counter()` is CLOCK_MONOTONIC on Linux, one clock for every process of the machine,
so start and arrival times of all clients are on the parent's time line; a client whose clock is
off from the parent's by more than a second is refused (a platform whose counter is per
process).

Requests go to the clients by slot: with --max-concurrency C, client i owns C // N (+1 for the
first C % N) of the C slots, and request j goes to the owner of slot j % C, so the first C
requests still start together and each client's concurrency is its share; without a limit,
request j goes to client j % N. Every client sleeps until t0 + the request's offset, as one
process does. What N processes cannot do that one does: lend a slot across clients, so when a
client's requests run out early its slots idle while the others' queues drain.

How to tell the client was not the limit: each process's CPU utilisation over the run
(`time.process_time()` / wall time) is printed and saved (`client_cpu_util`), and on Linux the
share of the run it spent runnable but waiting for a CPU (`client_cpu_wait`, from
/proc/thread-self/schedstat). Utilisation near 1.0, or utilisation plus wait near 1.0 on a
crowded host, means a client process was busy the whole run: its ITLs and throughput are partly
its own. Well below 1 for both (say < 0.7 together), it was waiting on the server. To be sure,
run with `--num-clients 1` and `--num-clients 4`: if throughput and latencies agree and the
utilisation is well below 1, the client was not the limit.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

import sluice
from sluice.bench.http_stream import ConnectionPool
from sluice.bench.openai_client import PreparedRequest, RequestInput, prepare, send_request
from sluice.bench.serve_metrics import RequestTiming
from sluice.event_loop import run_event_loop, running_loop_name

SCHEMA_VERSION = 1
# Lead of the common start over the parent's clock when it sends ClientStart: enough for every
# client to read the message first.
_START_LEAD_S = 0.1
_MAX_CLOCK_SKEW_S = 1.0
_MAX_LINE_BYTES = 1 << 31


class ClientJob(msgspec.Struct, tag="job", frozen=True):
    schema: int
    requests: list[RequestInput]
    offsets: list[float]  # send times, seconds after t0, one per request
    max_concurrency: int | None
    api_key: str | None
    warmup_request: RequestInput  # the run's first request, as one process warms up with
    num_warmups: int
    report_progress: bool


class ClientStart(msgspec.Struct, tag="start", frozen=True):
    t0: float  # perf_counter clock


class ClientReady(msgspec.Struct, tag="ready", frozen=True):
    schema: int
    clock: float  # the client's perf_counter() when it sent this


class ClientProgress(msgspec.Struct, tag="progress", frozen=True):
    completed: int


class ClientResult(msgspec.Struct, tag="result", frozen=True):
    timings: list[RequestTiming]
    end_s: float  # last request finished, seconds after t0
    cpu_s: float  # process CPU seconds over [t0, t0 + end_s]
    wait_s: float | None  # seconds runnable but waiting for a CPU then (None: not on Linux)
    event_loop: str  # "uvloop" | "asyncio"


_encoder = msgspec.json.Encoder()
_to_client = msgspec.json.Decoder(ClientJob | ClientStart)
_to_parent = msgspec.json.Decoder(ClientReady | ClientProgress | ClientResult)


@dataclass(frozen=True, slots=True)
class ClientsRun:
    timings: list[RequestTiming]  # in the order of the requests
    duration_s: float  # common start -> last finish
    cpu_util: list[float]  # per client process: CPU seconds / its wall seconds
    cpu_wait: list[float] | None  # per client process: run-queue wait / its wall seconds
    event_loop: str  # the clients' event loop: "uvloop" | "asyncio"

    @classmethod
    def of(cls, results: Sequence[ClientResult],
           timings: list[RequestTiming]) -> ClientsRun:
        waits = [r.wait_s for r in results]
        return cls(timings=timings, duration_s=max(r.end_s for r in results),
                   cpu_util=[r.cpu_s / r.end_s for r in results],
                   cpu_wait=None if None in waits else [w / r.end_s  # type: ignore[operator]
                                                        for w, r in zip(waits, results)],
                   event_loop=results[0].event_loop)


def concurrency_shares(max_concurrency: int | None, num_clients: int) -> list[int | None]:
    """Each client's --max-concurrency, as even as can be; None for no limit."""
    if num_clients < 1:
        raise ValueError(f"--num-clients must be >= 1, got {num_clients}")
    if max_concurrency is None:
        return [None] * num_clients
    if num_clients > max_concurrency:
        raise ValueError(f"--num-clients ({num_clients}) must be <= --max-concurrency "
                         f"({max_concurrency}): every client needs a request slot")
    base, extra = divmod(max_concurrency, num_clients)
    return [base + (i < extra) for i in range(num_clients)]


def request_owners(num_requests: int, shares: Sequence[int | None]) -> list[int]:
    """The client of each request: the owner of its slot (j % concurrency), else j % N."""
    if shares[0] is None:
        slots = list(range(len(shares)))
    else:
        slots = [client for client, share in enumerate(shares) for _ in range(share or 0)]
    return [slots[j % len(slots)] for j in range(num_requests)]


def run_queue_wait_s() -> float | None:
    """Seconds this thread has been runnable but not running (Linux schedstat), else None."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


async def _sleep_until(deadline: float) -> None:
    """Sleep until perf_counter() >= deadline (a loop's timer may fire a little early)."""
    while (delay := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(delay)


async def send_all(requests: Sequence[PreparedRequest], offsets: Sequence[float],
                   max_concurrency: int | None, t0: float, pool: ConnectionPool,
                   on_done: Callable[[], None] | None = None) -> ClientResult:
    """Send each request at t0 + its offset, at most `max_concurrency` in flight; the timings
    come back in request order, with this process's CPU and run-queue time from t0 to the last
    finish."""
    await _sleep_until(t0)
    cpu0, wait0 = time.process_time(), run_queue_wait_s()
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(request: PreparedRequest) -> RequestTiming:
        if limit is None:
            timing = await send_request(pool, request, t0)
        else:
            async with limit:
                timing = await send_request(pool, request, t0)
        if on_done is not None:
            on_done()
        return timing

    tasks = []
    for request, offset in zip(requests, offsets):
        await _sleep_until(t0 + offset)
        tasks.append(asyncio.create_task(one(request)))
    timings = list(await asyncio.gather(*tasks))
    end_s = time.perf_counter() - t0
    wait1 = run_queue_wait_s()
    return ClientResult(timings=timings, end_s=end_s, cpu_s=time.process_time() - cpu0,
                        wait_s=None if wait0 is None or wait1 is None else wait1 - wait0,
                        event_loop=running_loop_name())


async def warm_up(pool: ConnectionPool, request: PreparedRequest, num: int) -> None:
    if num:
        await asyncio.gather(*[send_request(pool, request) for _ in range(num)])


async def run_in_process(inputs: Sequence[RequestInput], offsets: Sequence[float],
                         max_concurrency: int | None, api_key: str | None, num_warmups: int,
                         on_done: Callable[[], None] | None = None) -> ClientsRun:
    pool = ConnectionPool()
    try:
        requests = [prepare(r, api_key) for r in inputs]
        if requests:
            await warm_up(pool, requests[0], num_warmups)
        result = await send_all(requests, offsets, max_concurrency, time.perf_counter(), pool,
                                on_done)
    finally:
        pool.close()
    return ClientsRun.of([result], result.timings)


def _client_env() -> dict[str, str]:
    """This environment, with the folder sluice is imported from first on the path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(sluice.__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


async def run_in_processes(inputs: Sequence[RequestInput], offsets: Sequence[float],
                           max_concurrency: int | None, num_clients: int, api_key: str | None,
                           num_warmups: int,
                           on_done: Callable[[], None] | None = None) -> ClientsRun:
    shares = concurrency_shares(max_concurrency, num_clients)
    if num_clients > len(inputs):
        raise ValueError(f"--num-clients ({num_clients}) must be <= the number of requests "
                         f"({len(inputs)})")
    owners = request_owners(len(inputs), shares)
    mine = [[j for j, owner in enumerate(owners) if owner == i] for i in range(num_clients)]
    warmups = [num_warmups // num_clients + (i < num_warmups % num_clients)
               for i in range(num_clients)]
    procs: list[asyncio.subprocess.Process] = []
    try:
        for i in range(num_clients):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sluice.bench.load_clients", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=_client_env(), limit=_MAX_LINE_BYTES))
            job = ClientJob(schema=SCHEMA_VERSION, requests=[inputs[j] for j in mine[i]],
                            offsets=[float(offsets[j]) for j in mine[i]],
                            max_concurrency=shares[i], api_key=api_key,
                            warmup_request=inputs[0], num_warmups=warmups[i],
                            report_progress=on_done is not None)
            await _send(procs[i], job)
        for i, proc in enumerate(procs):
            ready = await _receive(proc, i)
            if not isinstance(ready, ClientReady) or ready.schema != SCHEMA_VERSION:
                raise RuntimeError(f"client process {i} answered {ready!r}, not ClientReady "
                                   f"of schema {SCHEMA_VERSION}")
            skew = time.perf_counter() - ready.clock
            if not 0 <= skew < _MAX_CLOCK_SKEW_S:
                raise RuntimeError(f"client process {i}'s perf_counter is {skew:.3f} s off this "
                                   f"process's: the clients cannot share one time line here")
        t0 = time.perf_counter() + _START_LEAD_S
        for proc in procs:
            await _send(proc, ClientStart(t0=t0))
        results = await asyncio.gather(*[_collect(proc, i, on_done)
                                         for i, proc in enumerate(procs)])
        for i, proc in enumerate(procs):
            if await proc.wait() != 0:
                raise RuntimeError(f"client process {i} exited with {proc.returncode}")
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    timings: list[RequestTiming | None] = [None] * len(inputs)
    for i, result in enumerate(results):
        if len(result.timings) != len(mine[i]):
            raise RuntimeError(f"client process {i} returned {len(result.timings)} timings for "
                               f"{len(mine[i])} requests")
        for j, timing in zip(mine[i], result.timings):
            timings[j] = timing
    assert all(t is not None for t in timings)
    return ClientsRun.of(results, timings)  # type: ignore[arg-type]


async def _send(proc: asyncio.subprocess.Process, message: msgspec.Struct) -> None:
    assert proc.stdin is not None
    proc.stdin.write(_encoder.encode(message) + b"\n")
    await proc.stdin.drain()


async def _receive(proc: asyncio.subprocess.Process, index: int) -> Any:
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    if not line:
        code = await proc.wait()
        raise RuntimeError(f"client process {index} exited with {code} before its result (its "
                           f"traceback is above)")
    return _to_parent.decode(line)


async def _collect(proc: asyncio.subprocess.Process, index: int,
                   on_done: Callable[[], None] | None) -> ClientResult:
    while True:
        message = await _receive(proc, index)
        if isinstance(message, ClientResult):
            return message
        if isinstance(message, ClientProgress) and on_done is not None:
            for _ in range(message.completed):
                on_done()


async def _client_main(stdin: Any, out: Any) -> None:
    job = _to_client.decode(stdin.readline())
    if not isinstance(job, ClientJob) or job.schema != SCHEMA_VERSION:
        raise RuntimeError(f"expected a ClientJob of schema {SCHEMA_VERSION}, got {job!r}")
    pool = ConnectionPool()
    try:
        requests = [prepare(r, job.api_key) for r in job.requests]
        await warm_up(pool, prepare(job.warmup_request, job.api_key), job.num_warmups)
        out.write(_encoder.encode(ClientReady(schema=SCHEMA_VERSION,
                                              clock=time.perf_counter())) + b"\n")
        # Blocking read: nothing else runs in this process until the start.
        start = _to_client.decode(stdin.readline())
        if not isinstance(start, ClientStart):
            raise RuntimeError(f"expected ClientStart, got {start!r}")
        progress_line = _encoder.encode(ClientProgress(completed=1)) + b"\n"

        def on_done() -> None:
            out.write(progress_line)

        result = await send_all(requests, job.offsets, job.max_concurrency, start.t0, pool,
                                on_done if job.report_progress else None)
    finally:
        pool.close()
    out.write(_encoder.encode(result) + b"\n")


def main() -> None:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    run_event_loop(_client_main(sys.stdin.buffer, out))
    out.close()


if __name__ == "__main__":
    main()
