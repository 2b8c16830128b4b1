"""PD disaggregation over the same-host backend (shm), as users run it: two `sluice serve
--disaggregation-mode prefill` instances (one `shm`, one `auto`), an `auto` decode and a
`sluice router`, real processes on free loopback ports, chunked prefill (a 32-token step budget)
and prefix caching on. Outputs equal the colocated server's; `auto` pairs over shm; each
prefill maps the decode's cache once; a prefill killed with transfers under way loses no
request and no block; nothing is left in /dev/shm or mapped once the decode is gone."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from sluice.testing.instances import Instance
from sluice.testing.pd_cluster import PDCluster, start_cluster, wait_blocks_back
from tests.server.conftest import ServerProcess
from tests.server.test_disagg_serving import (
    FLAGS,
    Call,
    assert_blocks_back,
    assert_layerwise,
    assert_same,
    calls,
    connector_stats,
    kill_a_prefill_mid_transfer,
    reference,
    router_metric,
    run_calls,
)

pytestmark = pytest.mark.serial

HEARTBEAT = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 2, "heartbeat_timeout_s": 0.5,
             "waiting_timeout_s": 20.0, "bootstrap_timeout_s": 20.0}
CHUNKED = ["--max-num-batched-tokens", "32"]  # prompts of up to ~70 tokens: several chunks
SEGMENT = "memfd:sluice-kv-"


@pytest.fixture(scope="module")
def pd(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    """prefill0 (shm, holds its writes while a test asks), prefill1 (auto), decode (auto)."""
    workdir = tmp_path_factory.mktemp("pd-shm")
    hold_file = workdir / "hold-transfers"
    cluster = start_cluster(
        qwen3_dir, [*FLAGS, *CHUNKED], "auto", num_prefills=2, prefill_backends=["shm", "auto"],
        prefill_env=[{"SLUICE_PD_FAULT_SEND_HOLD_FILE": str(hold_file)}, {}],
        # A decode half the router never delivered (a reused connection that breaks) leaves its
        # prefill holding the room until the send lease: within the 20 s the checks wait.
        prefill_extra={"send_lease_s": 12.0}, decode_extra=HEARTBEAT,
        router_flags=["--health-check-interval", "0.5", "--health-failure-threshold", "2",
                      "--max-retries", "5"],
        workdir=workdir)
    cluster.hold_file = hold_file  # type: ignore[attr-defined]
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def every_block_back(pd: PDCluster) -> Iterator[None]:
    yield
    assert_blocks_back(pd)


def session_pids(instance: Instance) -> list[int]:
    """The instance's processes: its server, engine core and workers (a session of its own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == instance.pid:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def segment_mappings(instance: Instance) -> int:
    """Mappings of a decode's cache segment in the instance's processes."""
    count = 0
    for pid in session_pids(instance):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        count += sum(SEGMENT in line for line in maps.splitlines())
    return count


def leftover_segments() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if "sluice" in name]


def test_pd_over_shm_through_the_router_equals_colocated(pd: PDCluster,
                                                         server: ServerProcess) -> None:
    base = "Shared prefix " + " ".join(f"w{i}" for i in range(60))
    prefixed = [Call("cmpl", False, base, 4), Call("cmpl", True, base + " and more", 6)]
    batch = [*calls(32), *prefixed]
    want = reference(server, batch)
    before = connector_stats(pd.decodes[0])
    got = run_calls(pd.router.url, batch[:32])
    got += [run_calls(pd.router.url, [c])[0] for c in prefixed]  # the second reuses the first
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, (i, batch[i]))
    after = connector_stats(pd.decodes[0])
    rooms = after["worker_rooms_received"] - before.get("worker_rooms_received", 0)
    assert rooms >= 34
    # auto with both prefills on this host: every room over shm, none over Mooncake.
    assert after["worker_rooms_over_shm"] - before.get("worker_rooms_over_shm", 0) == rooms
    assert "worker_rooms_over_mooncake" not in after
    log = pd.decodes[0].log()
    for prefill in pd.prefills:
        assert f"127.0.0.1:{prefill.bootstrap_port} pairs over shm (same host)" in log
    for prefill in pd.prefills:
        assert connector_stats(prefill)["worker_rooms_sent"] > 0
    assert router_metric(pd.router, "sluice_router_retries_total") == 0
    for prefill in pd.prefills:
        assert_layerwise(prefill)
    # The decode's own prefix cache served the shared prefix's blocks.
    assert after["local_hit_blocks"] - before.get("local_hit_blocks", 0) >= 8


def test_each_prefill_maps_the_decodes_cache_once_and_nothing_is_named_in_dev_shm(
        pd: PDCluster) -> None:
    run_calls(pd.router.url, calls(4, seed=2))
    for prefill in pd.prefills:
        assert segment_mappings(prefill) == 1, prefill  # one decode rank, mapped once
    assert segment_mappings(pd.decodes[0]) == 1  # its own
    assert leftover_segments() == []


def test_sigkill_of_a_prefill_mid_transfer_over_shm_loses_no_request(
        pd: PDCluster, server: ServerProcess) -> None:
    dying, survivor = pd.prefills
    decode, router = pd.decodes[0], pd.router
    batch = [replace(c, max_tokens=24 + i % 8) for i, c in enumerate(calls(16, seed=5))]
    want = reference(server, batch)

    def mapped() -> None:
        assert segment_mappings(dying) == 1  # it has the decode's cache mapped
        # Layer-wise, its rooms' KV went out during their prompts; their status is held.
        assert connector_stats(dying).get("worker_layer_writes", 0) > 0

    got, before = kill_a_prefill_mid_transfer(pd, dying, batch, 16, 3 * 0.5 + 0.5 + 5,
                                              before_kill=mapped)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, (i, batch[i]))  # retried on the survivor, over shm
    wait_blocks_back(decode, timeout_s=10)
    after = connector_stats(decode)
    assert after["worker_prefills_lost"] > before.get("worker_prefills_lost", 0)
    assert after["worker_rooms_failed"] > before.get("worker_rooms_failed", 0)
    assert router_metric(router, "sluice_router_retries_total") > 0
    assert segment_mappings(survivor) == 1
    assert leftover_segments() == []


def test_a_stopped_decode_leaves_no_segment_and_its_mapping_is_closed(pd: PDCluster) -> None:
    decode, survivor = pd.decodes[0], pd.prefills[1]
    assert segment_mappings(survivor) == 1
    assert decode.stop() == 0  # SIGTERM: a clean shutdown
    deadline = time.monotonic() + 5  # the prefill's sweep looks about once a second
    while segment_mappings(survivor):
        assert time.monotonic() < deadline, "the prefill kept the gone decode's cache mapped"
        time.sleep(0.1)
    assert leftover_segments() == []
    assert httpx.get(f"{survivor.url}/health").status_code == 200
