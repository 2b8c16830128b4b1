"""The PD transfer layer without an engine: KVPoll, descriptors, the bootstrap server, and a
prefill rank's and a decode rank's KVManager moving real bytes between two caches over both
backends (Mooncake Transfer Engine over TCP, and the fake loopback one), under every fault the
managers must bound: a lost prefill, an abort before and during a write, a dropped status, a
write that fails, a decode that never asks, a page-size mismatch."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from sluice.core.kv_connector import KVCacheSpec
from sluice.kv_transfer.disagg import bootstrap
from sluice.kv_transfer.disagg.config import PDConfig
from sluice.kv_transfer.disagg.descriptors import (
    CacheLayout,
    batches,
    block_runs,
    build_descriptors,
)
from sluice.kv_transfer.disagg.faults import Faults
from sluice.kv_transfer.disagg.manager import Finished, KVManager
from sluice.kv_transfer.disagg.messages import RankRoute
from sluice.kv_transfer.disagg.poll import KVPoll, advance, consensus
from sluice.kv_transfer.disagg.receiver import DecodeKVManager
from sluice.kv_transfer.disagg.sender import PrefillKVManager
from sluice.kv_transfer.disagg.shm import SharedKVArena
from sluice.testing.servers import free_port

pytestmark = pytest.mark.serial

BACKENDS = ("fake", "mooncake", "shm")


def require_backend(backend: str) -> None:
    if backend != "mooncake":
        return
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Mooncake PD tests: {exc}")
        pytest.skip(f"Mooncake Transfer Engine not importable: {exc}")


def test_kvpoll_moves_forward_only_failed_is_sticky_and_the_minimum_is_the_consensus() -> None:
    assert [p.value for p in KVPoll] == [0, 1, 2, 3, 4]
    assert advance(KVPoll.Bootstrapping, KVPoll.Transferring) == KVPoll.Transferring
    assert advance(KVPoll.Transferring, KVPoll.WaitingForInput) == KVPoll.Transferring
    assert advance(KVPoll.Transferring, KVPoll.Failed) == KVPoll.Failed
    assert advance(KVPoll.Failed, KVPoll.Success) == KVPoll.Failed
    assert consensus([KVPoll.Success, KVPoll.Transferring]) == KVPoll.Transferring
    assert consensus([KVPoll.Success, KVPoll.Failed, KVPoll.Success]) == KVPoll.Failed


def test_descriptors_coalesce_runs_consecutive_on_both_sides_per_layer_and_half() -> None:
    assert block_runs([5, 6, 7, 12, 13], [9, 10, 11, 2, 3]) == [(5, 9, 3), (12, 2, 2)]
    assert block_runs([1, 2, 3], [4, 6, 7]) == [(1, 4, 1), (2, 6, 2)]
    # 2 tokens a block, 1 head of 2 bytes: 4 bytes a half block
    src = CacheLayout((1000, 9000), num_blocks=10, block_size=2, num_kv_heads=1, head_bytes=2)
    dst = CacheLayout((50_000, 70_000), num_blocks=20, block_size=2, num_kv_heads=1,
                      head_bytes=2)
    s, d, n = build_descriptors(src, dst, [(5, 9, 3)])
    # layer 0 K, layer 0 V (after 10 / 20 blocks of K), layer 1 K, layer 1 V; 4 bytes a half
    assert s == [1000 + 5 * 4, 1000 + 10 * 4 + 5 * 4, 9000 + 20, 9000 + 40 + 20]
    assert d == [50_000 + 36, 50_000 + 80 + 36, 70_000 + 36, 70_000 + 80 + 36]
    assert n == [12, 12, 12, 12]
    assert batches(2500, 1024) == [(0, 1024), (1024, 2048), (2048, 2500)]
    with pytest.raises(ValueError, match="blocks of 2 tokens"):
        build_descriptors(src, CacheLayout((1, 2), 10, 4, 1, 2), [(0, 0, 1)])


def _route(rank: int, world_size: int = 2) -> RankRoute:
    return RankRoute(rank=rank, world_size=world_size, control_address=f"tcp://127.0.0.1:{rank}",
                     backend="fake", block_size=8, kv_dtype="float32", head_dim=4,
                     num_kv_heads=2, model_num_kv_heads=2 * world_size, num_layers=2,
                     engine_id="p")


def test_bootstrap_server_routes_only_once_every_rank_registered_and_ranks_retry() -> None:
    port = free_port()
    # A rank may come up before its server: it retries until the server answers.
    result: list[bool] = []
    early = threading.Thread(target=lambda: result.append(
        bootstrap.register(f"127.0.0.1:{port}", _route(1), timeout_s=20)))
    early.start()
    time.sleep(0.3)
    server = bootstrap.BootstrapServer("127.0.0.1", port, world_size=2)
    try:
        early.join(20)
        assert result == [True]
        with httpx.Client(timeout=5) as client:
            with pytest.raises(bootstrap.RouteUnavailable, match="1 of 2"):
                bootstrap.fetch_route(client, server.address)
            assert bootstrap.register(server.address, _route(0), timeout_s=5)
            route = bootstrap.fetch_route(client, server.address)
            assert [r.rank for r in route.ranks] == [0, 1]
            assert bootstrap.probe_health(client, server.address) == route.instance_id
            bad = client.put(f"http://{server.address}/route", content=b'{"rank": "x"}')
            assert bad.status_code == 400 and "not a RankRoute" in bad.text
            wrong = client.put(f"http://{server.address}/route",
                               content=msgspec.json.encode(_route(3, world_size=4)))
            assert wrong.status_code == 400 and "world size 2" in wrong.text
    finally:
        server.shutdown()
    with httpx.Client(timeout=1) as client:
        assert bootstrap.probe_health(client, server.address) is None


# ---- two managers ------------------------------------------------------------------------


def make_spec(block_size: int = 4, layers: int = 2) -> KVCacheSpec:
    return KVCacheSpec(model="m", dtype="float32", block_size=block_size, num_kv_heads=2,
                       head_dim=4, layer_names=tuple(f"layer.{i}" for i in range(layers)))


def make_caches(spec: KVCacheSpec, num_blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    generator = torch.Generator().manual_seed(seed or 0)
    return {name: (torch.randn(shape, generator=generator) if seed is not None
                   else torch.zeros(shape)) for name in spec.layer_names}


@dataclass
class Pair:
    server: bootstrap.BootstrapServer
    prefill: PrefillKVManager
    decode: DecodeKVManager
    p_caches: dict[str, torch.Tensor]
    d_caches: dict[str, torch.Tensor]

    def wait(self, manager: KVManager, count: int = 1, timeout_s: float = 10.0
             ) -> list[Finished]:
        deadline = time.monotonic() + timeout_s
        got: list[Finished] = []
        while len(got) < count:
            assert time.monotonic() < deadline, f"{type(manager).__name__}: {got}"
            got += manager.take_finished()
            time.sleep(0.01)
        return got


@contextlib.contextmanager
def pd_pair(backend: str, faults: Faults | None = None, p_spec: KVCacheSpec | None = None,
            d_spec: KVCacheSpec | None = None, p_blocks: int = 64, d_blocks: int = 64,
            **decode_config: object) -> Iterator[Pair]:
    require_backend(backend)
    p_spec, d_spec = p_spec or make_spec(), d_spec or make_spec()
    server = bootstrap.BootstrapServer("127.0.0.1", 0, world_size=1)
    p_caches, d_caches = make_caches(p_spec, p_blocks, seed=1), make_caches(d_spec, d_blocks,
                                                                            seed=None)
    arena = None
    if backend == "shm":  # the decode's cache in shared memory, as its connector places it
        arena = SharedKVArena("test-decode")
        first = next(iter(d_caches.values()))
        d_caches = arena.allocate(list(d_caches), tuple(first.shape), first.dtype,
                                  first.device)
    prefill = PrefillKVManager(
        PDConfig(role="prefill", engine_id="p", transfer_backend=backend,
                 bootstrap_port=server.port, send_lease_s=decode_config.pop("send_lease_s", 30)),
        p_spec, p_caches, faults)
    decode = DecodeKVManager(
        PDConfig(role="decode", engine_id="d", transfer_backend=backend,
                 **{"heartbeat_interval_s": 0.2, "heartbeat_misses": 2, **decode_config}),
        d_spec, d_caches, arena=arena)
    try:
        prefill.start()
        decode.start()
        assert prefill.registered.wait(10)
        yield Pair(server, prefill, decode, p_caches, d_caches)
    finally:
        decode.shutdown()
        prefill.shutdown()
        server.shutdown()


def blocks_equal(pair: Pair, src: list[int], dst: list[int]) -> bool:
    return all(torch.equal(pair.p_caches[name][:, src], pair.d_caches[name][:, dst])
               for name in pair.p_caches)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_room_writes_the_blocks_then_hands_over_the_first_token(backend: str) -> None:
    with pd_pair(backend) as pair:
        src = [3, 4, 5, 9, 10, 11, 40]
        dst = [7, 8, 9, 1, 2, 30, 31]  # past the first: runs of 2, 2, 1 and 1 pairs
        pair.decode.receiver(77).init("d-req", pair.server.address, dst[1:], first_block=1,
                                      num_prompt_tokens=27)
        logprobs = {42: (-0.5, 1), 7: (-1.5, 2)}
        pair.prefill.sender(77).send("p-req", src, 27, first_token=42, first_logprobs=logprobs)
        [received] = pair.wait(pair.decode)
        [sent] = pair.wait(pair.prefill)
        assert (received.req_id, received.ok, received.first_token) == ("d-req", True, 42)
        assert received.first_logprobs == logprobs
        assert (sent.req_id, sent.ok) == ("p-req", True)
        assert blocks_equal(pair, src[1:], dst[1:])
        assert not pair.d_caches["layer.0"][:, dst[0]].any()  # the local prefix hit: untouched
        stats = pair.prefill.take_stats()
        assert stats["sent_blocks"] == 6 and stats["rooms_sent"] == 1
        # 4 runs of consecutive pairs x 2 layers x K and V
        assert stats["sent_descriptors"] == 4 * 2 * 2
        assert pair.decode.poll(77) == KVPoll.Failed  # forgotten once done (unknown room)


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_above_the_per_peer_limit_go_in_several_batches(backend: str) -> None:
    spec = make_spec(block_size=1, layers=2)
    with pd_pair(backend, p_spec=spec, d_spec=spec, p_blocks=1400, d_blocks=1400) as pair:
        src = list(range(0, 1400, 2))  # no two consecutive: 700 runs x 2 layers x 2 halves
        dst = list(range(1, 1400, 2))
        pair.decode.receiver(5).init("d", pair.server.address, dst, 0, num_prompt_tokens=700)
        pair.prefill.sender(5).send("p", src, 700, first_token=1, first_logprobs=None)
        [received] = pair.wait(pair.decode, timeout_s=30)
        assert received.ok, received.error
        assert pair.prefill.take_stats()["sent_descriptors"] == 2800  # > 1024: split
        assert blocks_equal(pair, src, dst)


def test_page_size_mismatch_is_refused_with_a_clear_message_and_nothing_written() -> None:
    with pd_pair("fake", p_spec=make_spec(block_size=8), d_spec=make_spec(block_size=4)) as pair:
        pair.decode.receiver(9).init("d", pair.server.address, [1, 2], 0, num_prompt_tokens=8)
        [received] = pair.wait(pair.decode)
        assert not received.ok and received.failed_block_ids == [1, 2]
        assert "page size mismatch" in received.error
        assert "block size 8, this decode instance 4" in received.error
        assert not any(t.any() for t in pair.d_caches.values())
        # The prefill hears of it, so a send it plans for the room ends at once.
        deadline = time.monotonic() + 5
        while 9 not in pair.prefill.rooms:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pair.prefill.sender(9).send("p", [1, 2], 8, first_token=3, first_logprobs=None)
        [sent] = pair.wait(pair.prefill, timeout_s=2)
        assert not sent.ok and "page size mismatch" in sent.error


def test_a_lost_prefill_fails_every_room_it_owned_within_the_heartbeat_bound() -> None:
    with pd_pair("fake", heartbeat_interval_s=0.2, heartbeat_misses=2) as pair:
        for room in (1, 2, 3):  # asked, but the prefill never gets its requests
            pair.decode.receiver(room).init(f"d{room}", pair.server.address, [room], 0, 3)
        time.sleep(0.3)
        killed = time.monotonic()
        pair.server.shutdown()  # the prefill's process is gone
        finished = pair.wait(pair.decode, count=3)
        elapsed = time.monotonic() - killed
        assert elapsed <= pair.decode.config.heartbeat_bound_s + 0.5
        assert {f.req_id for f in finished} == {"d1", "d2", "d3"}
        assert all("lost: 2 health probes failed" in f.error for f in finished)


def test_abort_during_the_write_delay_frees_the_prefill_then_the_decode() -> None:
    with pd_pair("fake", faults=Faults(send_delay_s=0.6)) as pair:
        pair.decode.receiver(11).init("d", pair.server.address, [4, 5], 0, 8)
        pair.prefill.sender(11).send("p", [1, 2], 8, first_token=3, first_logprobs=None)
        deadline = time.monotonic() + 5
        while pair.prefill.poll(11) != KVPoll.Transferring:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pair.decode.receiver(11).abort("client gone")
        [sent] = pair.wait(pair.prefill)
        [received] = pair.wait(pair.decode)
        assert not sent.ok and "decode aborted the room" in sent.error
        # The decode freed the blocks on the prefill's word (it may still have been writing),
        # not on its own.
        assert not received.ok and "failed the room (rank 0): decode aborted the room" in \
            received.error
        assert not any(t.any() for t in pair.d_caches.values())


def test_a_held_write_waits_for_its_file_to_go_and_an_abort_ends_a_held_room(
        tmp_path: Path) -> None:
    hold_file = tmp_path / "hold"
    faults = Faults.from_environ({"SLUICE_PD_FAULT_SEND_HOLD_FILE": str(hold_file)})
    assert faults.active and not faults.holding()
    hold_file.touch()
    assert faults.holding()
    with pd_pair("fake", faults=faults) as pair:
        for room, dst in ((21, [4, 5]), (22, [6, 7])):
            pair.decode.receiver(room).init(f"d{room}", pair.server.address, dst, 0, 8)
        pair.prefill.sender(21).send("p21", [1, 2], 8, first_token=3, first_logprobs=None)
        pair.prefill.sender(22).send("p22", [8, 9], 8, first_token=4, first_logprobs=None)
        time.sleep(0.5)  # held however long it takes
        assert pair.prefill.poll(21) == pair.prefill.poll(22) == KVPoll.Transferring
        assert not any(t.any() for t in pair.d_caches.values())
        pair.decode.receiver(22).abort("client gone")  # ends at once, though held
        [sent] = pair.wait(pair.prefill, timeout_s=2)
        assert (sent.req_id, sent.ok) == ("p22", False)
        assert pair.prefill.poll(21) == KVPoll.Transferring
        hold_file.unlink()
        [received] = [f for f in pair.wait(pair.decode, count=2) if f.req_id == "d21"]
        assert received.ok and received.first_token == 3
        assert blocks_equal(pair, [1, 2], [4, 5])
        assert not pair.d_caches["layer.0"][:, [6, 7]].any()


def test_abort_before_the_ask_tells_the_prefill_so_it_frees_its_blocks_at_once() -> None:
    with pd_pair("fake", send_lease_s=30) as pair:
        receiver = pair.decode.receiver(12)
        pair.server.shutdown()  # no route: the room stays Bootstrapping
        receiver.init("d", pair.server.address, [4], 0, 3)
        time.sleep(0.1)
        receiver.abort("client gone")
        [received] = pair.wait(pair.decode)
        assert "before the prefill was asked" in received.error
    # With the route: the abort reaches the prefill before its request finished (whether
    # decode had asked already or not); the send planned afterwards ends at once instead of
    # waiting out the send lease.
    with pd_pair("fake", send_lease_s=30) as pair:
        receiver = pair.decode.receiver(13)
        receiver.init("d", pair.server.address, [4], 0, 3)
        receiver.abort("client gone")
        pair.wait(pair.decode)
        deadline = time.monotonic() + 5
        while pair.prefill.poll(13) != KVPoll.Failed or 13 not in pair.prefill.rooms:
            assert time.monotonic() < deadline, "the prefill never heard of the abort"
            time.sleep(0.01)
        pair.prefill.sender(13).send("p", [1], 3, first_token=3, first_logprobs=None)
        [sent] = pair.wait(pair.prefill, timeout_s=2)
        assert not sent.ok and "decode aborted" in sent.error


def test_a_dropped_status_ends_in_the_waiting_timeout() -> None:
    with pd_pair("fake", faults=Faults(drop_status_prob=1.0), waiting_timeout_s=1.0) as pair:
        pair.decode.receiver(21).init("d", pair.server.address, [4], 0, 3)
        pair.prefill.sender(21).send("p", [1], 3, first_token=3, first_logprobs=None)
        started = time.monotonic()
        [sent] = pair.wait(pair.prefill)
        assert sent.ok  # written; only the word of it was lost
        [received] = pair.wait(pair.decode, timeout_s=5)
        assert not received.ok and "waiting_timeout_s" in received.error
        assert time.monotonic() - started < 2.0


def test_an_injected_write_failure_fails_the_room_on_both_sides() -> None:
    with pd_pair("fake", faults=Faults(transfer_fail_prob=1.0)) as pair:
        pair.decode.receiver(31).init("d", pair.server.address, [4], 0, 3)
        pair.prefill.sender(31).send("p", [1], 3, first_token=3, first_logprobs=None)
        [sent], [received] = pair.wait(pair.prefill), pair.wait(pair.decode)
        assert not sent.ok and not received.ok
        assert "injected" in received.error and received.failed_block_ids == [4]


def test_a_suspect_decode_endpoint_is_probed_and_then_used_again() -> None:
    with pd_pair("fake") as pair:
        # A write to it failed.
        pair.prefill._suspect_peers.add(pair.decode.backends["fake"].session)
        pair.decode.receiver(41).init("d", pair.server.address, [4], 0, 3)
        pair.prefill.sender(41).send("p", [1], 3, first_token=3, first_logprobs=None)
        [received] = pair.wait(pair.decode)
        assert received.ok and not pair.prefill._suspect_peers


def test_a_send_nobody_asks_for_is_freed_when_its_lease_runs_out() -> None:
    with pd_pair("fake", send_lease_s=0.5) as pair:
        pair.prefill.sender(51).send("p", [1], 3, first_token=3, first_logprobs=None)
        started = time.monotonic()
        [sent] = pair.wait(pair.prefill, timeout_s=3)
        assert not sent.ok and "send lease" in sent.error
        assert 0.4 <= time.monotonic() - started < 1.5
        # A decode that asks now is told the room failed, not left waiting.
        pair.decode.receiver(51).init("d", pair.server.address, [4], 0, 3)
        [received] = pair.wait(pair.decode, timeout_s=3)
        assert not received.ok and "send lease" in received.error


def test_disaggregation_flags_build_the_connector_config_and_bad_ones_say_why(
        qwen3_dir: str) -> None:
    from sluice.config import KVTransferConfig
    from sluice.engine.arg_utils import EngineArgs

    decode = EngineArgs(model=qwen3_dir, disaggregation_mode="decode",
                        disaggregation_transfer_backend="fake").create_engine_config()
    config = decode.kv_transfer_config
    assert (config.kv_connector, config.kv_role) == ("PDConnector", "kv_consumer")
    assert config.kv_load_failure_policy == "fail"  # the router retries elsewhere
    prefill = EngineArgs(model=qwen3_dir, disaggregation_mode="prefill",
                         disaggregation_bootstrap_port=0).create_engine_config()
    port = prefill.kv_transfer_config.kv_connector_extra_config["bootstrap_port"]
    assert port > 0  # chosen once, so the server and the ranks agree
    with pytest.raises(ValueError, match="must be 'prefill' or 'decode'"):
        EngineArgs(model=qwen3_dir, disaggregation_mode="both").create_engine_config()
    with pytest.raises(ValueError, match="give one or the other"):
        EngineArgs(model=qwen3_dir, disaggregation_mode="decode",
                   kv_transfer_config={"kv_connector": "PDConnector"}).create_engine_config()
    bad = KVTransferConfig(kv_connector="PDConnector", kv_role="kv_consumer",
                           kv_connector_extra_config={"heartbeat_every": 1})
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['heart"):
        PDConfig.from_kv_transfer_config(bad)
    with pytest.raises(ValueError, match="kv_producer .* or kv_consumer"):
        PDConfig.from_kv_transfer_config(KVTransferConfig(kv_connector="PDConnector"))
    with pytest.raises(ValueError, match="transfer_backend must be one of"):
        PDConfig(role="decode", engine_id="d", transfer_backend="rdma")
    for bad_least in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"bootstrap_wait_min_tokens must be an integer "
                                             f">= 0, got {bad_least!r}"):
            PDConfig(role="prefill", engine_id="p", bootstrap_wait_min_tokens=bad_least)
    assert PDConfig(role="decode", engine_id="d").heartbeat_bound_s <= 10.0
