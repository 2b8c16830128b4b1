"""Prefill and decode instances of different tensor-parallel sizes as users run them: a
`sluice serve --tensor-parallel-size 2 --disaggregation-mode prefill` instance (two worker
processes, gloo), a TP = 1 decode instance and a `sluice router`, each its own process. Each
prefill rank writes its KV head into the decode's cache at that head's offset, so the greedy
output through the router equals the colocated TP = 1 server, for concurrent requests and a
decode-side prefix-cache hit, over the fake backend and Mooncake TCP; a prefill rank SIGKILLed
mid-transfer ends its requests in a clear 503 within the heartbeat bound, never a hang, and
every block comes back on the decode. (The transfer layer's own tests, including TP sizes that
do not divide and a failed sibling rank: tests/kv_transfer/test_disagg_hetero_tp.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from sluice.testing.pd_cluster import PDCluster, start_cluster, wait_blocks_back
from tests.engine.test_executor import alive
from tests.kv_transfer.test_disagg_transfer import require_backend
from tests.server.conftest import ServerProcess
from tests.server.test_disagg_serving import (
    FLAGS,
    HEARTBEAT,
    PREFILL_CHUNKS,
    Call,
    assert_blocks_back,
    assert_layerwise,
    assert_same,
    calls,
    connector_stats,
    heartbeat_bound_s,
    reference,
    router_metric,
    run_calls,
    transfers_held,
)

pytestmark = pytest.mark.serial


@pytest.fixture(scope="module", params=["fake", "mooncake"])
def pd_tp(request: pytest.FixtureRequest, qwen3_dir: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    """Prefill TP = 2 (on the fake backend its writes held while a test asks, so the kill test
    can act mid-transfer), decode TP = 1 with a 0.5 s heartbeat, a router retrying once."""
    backend = request.param
    require_backend(backend)
    workdir = tmp_path_factory.mktemp(f"pd-tp2-{backend}")
    hold_file = workdir / "hold-transfers"
    env = [{"SLUICE_PD_FAULT_SEND_HOLD_FILE": str(hold_file)}] if backend == "fake" else None
    # Each prefill rank writes its head of every token alone (sluice/kv_transfer/disagg/
    # descriptors.py): 32 descriptors of 64 bytes a block here, about 4,300 per rank for the
    # first test's 17 prompts, queued behind one another on each rank. Over Mooncake's TCP
    # transport on 2 busy cores they took 0.5 ms each (46 us on an idle machine), and a run
    # in three passed the 20 s waiting timeout (3 rooms retried): the bound is the TCP
    # transport's here, not the protocol's, so it is wider on that backend.
    decode_extra = HEARTBEAT if backend == "fake" else {**HEARTBEAT, "waiting_timeout_s": 90.0}
    cluster = start_cluster(
        qwen3_dir, FLAGS, backend, prefill_env=env, decode_extra=decode_extra,
        # prompts in several steps, so a decode's ask lands before most of their layers'
        # writes even when it reaches the prefill after the prompt's first step (layer-wise)
        prefill_flags=["--tensor-parallel-size", "2", *PREFILL_CHUNKS],
        router_flags=["--health-check-interval", "0.5", "--health-failure-threshold", "2",
                      "--max-retries", "1"],
        workdir=workdir)
    cluster.backend = backend  # type: ignore[attr-defined]
    cluster.hold_file = hold_file  # type: ignore[attr-defined]
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def every_block_back(pd_tp: PDCluster) -> Iterator[None]:
    yield
    assert_blocks_back(pd_tp)


def test_tp2_prefill_into_tp1_decode_through_the_router_equals_colocated(
        pd_tp: PDCluster, server: ServerProcess) -> None:
    prefill, decode = pd_tp.prefills[0], pd_tp.decodes[0]
    assert len(set(prefill.engine_info()["worker_pids"])) == 2
    batch = calls(16, seed=11)
    base = "Shared prefix " + " ".join(f"w{i}" for i in range(60))
    first, second = Call("cmpl", False, base, 6), Call("cmpl", True, base + " and more", 6)
    want = reference(server, [*batch, first, second])
    started = time.monotonic()
    got = run_calls(pd_tp.router.url, [*batch, first])
    elapsed = time.monotonic() - started
    before = connector_stats(decode)
    got.append(run_calls(pd_tp.router.url, [second])[0])
    after = connector_stats(decode)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, (i, [*batch, first, second][i]))
    assert router_metric(pd_tp.router, "sluice_router_retries_total") == 0
    # The second prompt's first blocks came from the decode's own prefix cache; the rest from
    # both prefill ranks, each its head.
    reused = after["local_hit_blocks"] - before["local_hit_blocks"]
    received = after["worker_received_blocks"] - before["worker_received_blocks"]
    assert reused >= 8 and reused + received == -(-got[-1]["usage"][0] // 8)
    sent = connector_stats(prefill)
    assert sent["registered_ranks"] == 2
    assert sent["worker_rooms_sent"] == 2 * after["worker_rooms_received"]  # per rank
    assert_layerwise(prefill)  # head slices too, each layer as it is stored
    print(f"17 requests, prefill TP 2 -> decode TP 1 over {pd_tp.backend}: "  # type: ignore
          f"{elapsed:.1f} s")


def test_a_prefill_rank_killed_mid_transfer_ends_in_a_clear_error_and_no_leak(
        pd_tp: PDCluster, server: ServerProcess) -> None:
    # Runs after the other test of its cluster (pytest groups a module's tests by the
    # fixture's param): the prefill does not come back.
    if pd_tp.backend != "fake":  # type: ignore[attr-defined]
        pytest.skip("needs the fake trio's held writes")
    prefill, decode, router = pd_tp.prefills[0], pd_tp.decodes[0], pd_tp.router
    worker_pids = prefill.engine_info()["worker_pids"]
    batch = [replace(c, max_tokens=12) for c in calls(8, seed=21)]
    want = reference(server, batch)

    def rooms_pending_on_both_ranks() -> bool:
        stats = connector_stats(prefill)
        done = stats.get("worker_rooms_sent", 0) + stats.get("worker_rooms_failed", 0)
        return 2 * stats.get("send_rooms", 0) - done >= 2

    async def scenario() -> tuple[list[Any], float]:
        results = asyncio.ensure_future(asyncio.to_thread(
            run_calls, router.url, batch, 8, 60.0))
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(rooms_pending_on_both_ranks):
            assert time.monotonic() < deadline, "no room was ever pending on the prefill"
            await asyncio.sleep(0.02)
        os.kill(worker_pids[1], signal.SIGKILL)  # one rank, mid-transfer
        killed = time.monotonic()
        return await results, killed

    with transfers_held(pd_tp.hold_file):  # type: ignore[attr-defined]
        got, killed = asyncio.run(scenario())
    ended = time.monotonic()
    errors = []
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, openai.APIStatusError):
            assert g.status_code == 503 and "failed on every attempt" in str(g), g
            errors.append(g)
        else:  # done before the kill
            assert_same(g, w, (i, batch[i]))
    assert errors, "a request whose transfer was under way must have failed"
    print(f"prefill rank 1 killed: {len(errors)} of {len(batch)} requests ended in a 503 "
          f"{ended - killed:.1f} s later ({errors[0].message})")
    # Decode noticed within its heartbeat bound (then the router's one retry failed too).
    assert ended - killed <= heartbeat_bound_s() + 5
    wait_blocks_back(decode, timeout_s=5)
    assert connector_stats(decode)["worker_prefills_lost"] >= 1
    # The other prefill rank did not outlive its peer (nothing of it keeps writing).
    while any(alive(pid) for pid in worker_pids):
        assert time.monotonic() - killed < 10, "a prefill worker outlived the kill by 10 s"
        time.sleep(0.05)
    assert httpx.get(f"{decode.url}/health").status_code == 200
    assert httpx.get(f"{prefill.url}/health").status_code == 503  # its engine is gone
    prefill.kill()  # what is left of it: its server process
