"""Prefill and decode of different tensor-parallel sizes, at the transfer layer: the head plan
(who sends which heads to whom), and real KV managers (one per rank, one bootstrap server,
both backends) moving each prefill rank's heads into the decode rank that holds them, at their
offset, for every block, layer, K and V; a replicated head sent once (or to every decode rank
that holds it); a failed prefill rank failing the room only once its sibling stopped writing;
TP sizes that do not divide refused with a message naming both."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from sluice.core.kv_connector import KVCacheSpec
from sluice.kv_transfer.disagg import bootstrap
from sluice.kv_transfer.disagg.config import PDConfig
from sluice.kv_transfer.disagg.connector import LayerSendPlan
from sluice.kv_transfer.disagg.faults import Faults
from sluice.kv_transfer.disagg.heads import (
    HeadSlice,
    check_tp_pair,
    decode_peers,
    held_heads,
    plan_slices,
)
from sluice.kv_transfer.disagg.manager import Finished, KVManager
from sluice.kv_transfer.disagg.messages import AbortRoom
from sluice.kv_transfer.disagg.poll import KVPoll
from sluice.kv_transfer.disagg.receiver import DecodeKVManager
from sluice.kv_transfer.disagg.sender import PrefillKVManager
from sluice.kv_transfer.disagg.shm import SharedKVArena
from tests.kv_transfer.test_disagg_transfer import require_backend

pytestmark = pytest.mark.serial

BLOCK, HEAD_DIM, LAYERS, NUM_BLOCKS = 4, 4, 2, 32


def test_head_plans_write_every_decode_head_once_and_sizes_must_divide() -> None:
    # GQA, 2 KV heads: prefill TP 2 -> decode TP 1, each prefill rank its head, at its offset.
    assert plan_slices(2, 2, 1, 0) == [HeadSlice(0, 0, 0, 0, 1), HeadSlice(1, 0, 0, 1, 1)]
    # Prefill TP 1 -> decode TP 2: the one prefill rank sends each decode rank its head.
    assert plan_slices(2, 1, 2, 1) == [HeadSlice(0, 1, 1, 0, 1)]
    assert decode_peers(1, 2, 0) == [0, 1]
    # MQA (one KV head, replicated): only the first of its holders sends it; the other is
    # asked with nothing to write, so it still frees its blocks.
    assert plan_slices(1, 2, 1, 0) == [HeadSlice(0, 0, 0, 0, 1), HeadSlice(1, 0, 0, 0, 0)]
    # ... and every decode rank holding a replica gets its own copy.
    assert [plan_slices(1, 1, 2, d) for d in (0, 1)] == [[HeadSlice(0, 0, 0, 0, 1)],
                                                         [HeadSlice(0, 1, 0, 0, 1)]]
    # 2 heads over prefill TP 4 (each on 2 ranks) -> decode TP 2: ranks 0 and 2 send.
    assert [s.num_heads for d in (0, 1) for s in plan_slices(2, 4, 2, d)] == [1, 0, 1, 0]
    assert held_heads(8, 4, 3) == range(6, 8) and held_heads(2, 4, 3) == range(1, 2)
    with pytest.raises(ValueError, match="the prefill instance has 2 ranks, the decode "
                                         "instance 3; one must be a multiple of the other"):
        check_tp_pair(2, 3)


def rank_spec(model_heads: int, tp_size: int, rank: int) -> KVCacheSpec:
    return KVCacheSpec(model="m", dtype="float32", block_size=BLOCK,
                       num_kv_heads=len(held_heads(model_heads, tp_size, rank)),
                       head_dim=HEAD_DIM, layer_names=tuple(f"layer.{i}" for i in range(LAYERS)),
                       tp_rank=rank, tp_size=tp_size, model_num_kv_heads=model_heads)


@dataclass
class Instances:
    """One prefill instance's ranks (sharing a bootstrap server) and one decode instance's."""

    server: bootstrap.BootstrapServer
    prefills: list[PrefillKVManager]
    decodes: list[DecodeKVManager]
    # The whole model's KV: [2, blocks, block_size, model heads, head_dim] per layer; each
    # prefill rank's cache holds its heads of it.
    full: dict[str, torch.Tensor]
    decode_caches: list[dict[str, torch.Tensor]]
    model_heads: int

    def recv(self, room: int, dst: list[int], num_prompt_tokens: int) -> None:
        for decode in self.decodes:
            decode.receiver(room).init(f"d{room}", self.server.address, dst, 0,
                                       num_prompt_tokens)

    def send(self, room: int, src: list[int], num_prompt_tokens: int, first_token: int = 7
             ) -> None:
        for prefill in self.prefills:
            prefill.sender(room).send(f"p{room}", src, num_prompt_tokens, first_token, None)

    def assert_received(self, src: list[int], dst: list[int]) -> None:
        for rank, caches in enumerate(self.decode_caches):
            heads = held_heads(self.model_heads, len(self.decodes), rank)
            for name, full in self.full.items():
                want = full[:, src][:, :, :, heads.start:heads.stop]
                assert torch.equal(caches[name][:, dst], want), (rank, name)


def wait(manager: KVManager, count: int = 1, timeout_s: float = 10.0) -> list[Finished]:
    deadline = time.monotonic() + timeout_s
    got: list[Finished] = []
    while len(got) < count:
        assert time.monotonic() < deadline, f"{type(manager).__name__} rank " \
                                            f"{manager.rank}: {got}"
        got += manager.take_finished()
        time.sleep(0.01)
    return got


@contextlib.contextmanager
def instances(backend: str, model_heads: int, prefill_tp: int, decode_tp: int,
              faults: list[Faults] | None = None, **decode_config: object
              ) -> Iterator[Instances]:
    require_backend(backend)
    server = bootstrap.BootstrapServer("127.0.0.1", 0, world_size=prefill_tp)
    shape = (2, NUM_BLOCKS, BLOCK, model_heads, HEAD_DIM)
    generator = torch.Generator().manual_seed(0)
    full = {f"layer.{i}": torch.randn(shape, generator=generator) for i in range(LAYERS)}
    prefills, decodes, decode_caches = [], [], []
    try:
        for rank in range(prefill_tp):
            heads = held_heads(model_heads, prefill_tp, rank)
            caches = {name: t[:, :, :, heads.start:heads.stop].contiguous()
                      for name, t in full.items()}
            prefills.append(PrefillKVManager(
                PDConfig(role="prefill", engine_id="p", transfer_backend=backend,
                         bootstrap_port=server.port, send_lease_s=30),
                rank_spec(model_heads, prefill_tp, rank), caches,
                (faults or [None] * prefill_tp)[rank]))
        for rank in range(decode_tp):
            spec = rank_spec(model_heads, decode_tp, rank)
            shape = (2, NUM_BLOCKS, BLOCK, spec.num_kv_heads, HEAD_DIM)
            arena = SharedKVArena(f"test-decode-{rank}") if backend == "shm" else None
            caches = (arena.allocate(list(full), shape, torch.float32, torch.device("cpu"))
                      if arena is not None else {name: torch.zeros(shape) for name in full})
            decode_caches.append(caches)
            decodes.append(DecodeKVManager(
                PDConfig(role="decode", engine_id="d", transfer_backend=backend,
                         **{"heartbeat_interval_s": 0.2, **decode_config}), spec, caches,
                arena=arena))
        for manager in [*prefills, *decodes]:
            manager.start()
        assert all(p.registered.wait(10) for p in prefills)
        yield Instances(server, prefills, decodes, full, decode_caches, model_heads)
    finally:
        for manager in [*decodes, *prefills]:
            manager.shutdown()
        server.shutdown()


@pytest.mark.parametrize(("backend", "model_heads", "prefill_tp", "decode_tp"), [
    ("fake", 2, 2, 1), ("fake", 1, 2, 1), ("fake", 2, 1, 2), ("fake", 1, 1, 2),
    ("fake", 4, 4, 2), ("mooncake", 2, 2, 1), ("mooncake", 2, 1, 2), ("shm", 2, 2, 1),
    ("shm", 2, 1, 2)])
def test_each_prefill_rank_writes_its_heads_into_the_decode_rank_that_holds_them(
        backend: str, model_heads: int, prefill_tp: int, decode_tp: int) -> None:
    with instances(backend, model_heads, prefill_tp, decode_tp) as pd:
        src = [3, 4, 5, 9, 10, 20]
        dst = [7, 8, 1, 2, 3, 30]  # runs of 2, 1, 2 and 1 pairs
        num_prompt_tokens = len(src) * BLOCK - 1
        pd.recv(5, dst, num_prompt_tokens)
        pd.send(5, src, num_prompt_tokens, first_token=42)
        for decode in pd.decodes:
            [received] = wait(decode)
            assert (received.ok, received.first_token) == (True, 42), received.error
        for prefill in pd.prefills:
            [sent] = wait(prefill)  # every prefill rank's blocks go back to its scheduler
            assert sent.ok, sent.error
            assert prefill.num_rooms() == 0
        pd.assert_received(src, dst)
        sent_bytes = [p.take_stats().get("sent_bytes", 0) for p in pd.prefills]
        # Each decode head is written once: the bytes moved are the decode side's cache.
        per_decode_rank = LAYERS * 2 * len(src) * BLOCK * HEAD_DIM * 4 * \
            pd.decodes[0].spec.num_kv_heads
        assert sum(sent_bytes) == decode_tp * per_decode_rank
        if model_heads < prefill_tp:  # a replica's holder other than the first sends nothing
            assert sent_bytes[1:] == [0] * (prefill_tp - 1)


@pytest.mark.parametrize(("backend", "model_heads", "prefill_tp", "decode_tp"), [
    ("fake", 2, 2, 1), ("fake", 1, 2, 1), ("fake", 2, 1, 2), ("mooncake", 2, 2, 1),
    ("shm", 2, 1, 2)])
def test_layer_wise_sends_write_each_ranks_heads_as_the_layers_are_stored(
        backend: str, model_heads: int, prefill_tp: int, decode_tp: int) -> None:
    with instances(backend, model_heads, prefill_tp, decode_tp) as pd:
        src, dst = [3, 4, 5, 9], [7, 8, 1, 2]
        num_prompt_tokens = len(src) * BLOCK - 1
        pd.recv(6, dst, num_prompt_tokens)
        deadline = time.monotonic() + 10
        while any(p.poll(6) != KVPoll.WaitingForInput for p in pd.prefills):
            assert time.monotonic() < deadline, "the decode ranks never asked"
            time.sleep(0.01)
        plan = LayerSendPlan(6, src, len(src), num_prompt_tokens)  # the prompt in one step
        for prefill in pd.prefills:  # each rank's worker, in its own process in an engine
            prefill.begin_layer_sends([plan])
            for layer in range(LAYERS):
                prefill.send_layer(layer, None)
            prefill.wait_layer_sends()
        pd.assert_received(src, dst)  # before any room's write
        pd.send(6, src, num_prompt_tokens, first_token=9)
        for decode in pd.decodes:
            [received] = wait(decode)
            assert (received.ok, received.first_token) == (True, 9), received.error
        stats = [p.take_stats() for p in pd.prefills]
        per_decode_rank = LAYERS * 2 * len(src) * BLOCK * HEAD_DIM * 4 * \
            pd.decodes[0].spec.num_kv_heads
        assert sum(s.get("layer_sent_bytes", 0) for s in stats) == decode_tp * per_decode_rank
        assert sum(s.get("sent_bytes", 0) for s in stats) == 0  # nothing left at the end


def test_a_failed_prefill_rank_fails_the_room_once_its_sibling_stopped_writing() -> None:
    # Rank 0's writes fail; rank 1's start 0.8 s late.
    faults = [Faults(transfer_fail_prob=1.0), Faults(send_delay_s=0.8)]
    with instances("fake", 2, 2, 1, faults) as pd:
        decode, (rank0, rank1) = pd.decodes[0], pd.prefills
        pd.recv(1, [1, 2], 8)
        pd.send(1, [3, 4], 8)
        [received] = wait(decode)
        [sent0], [sent1] = wait(rank0), wait(rank1)
        assert not received.ok and received.failed_block_ids == [1, 2]
        assert "(rank 0): transfer failed (injected" in received.error
        # Rank 1 heard of it (decode's AbortRoom) and gave up its delayed write.
        assert not sent0.ok and not sent1.ok
        assert "decode aborted the room: another prefill rank failed" in sent1.error
        assert not any(t.any() for t in pd.decode_caches[0].values())

        # A sibling that does not stop (its abort lost) is waited for: the blocks stay with
        # decode until its write ended, even though the room had already failed.
        handle = rank1.handle
        rank1.handle = lambda message: None if isinstance(message, AbortRoom) else \
            handle(message)
        pd.recv(2, [5, 6], 8)
        pd.send(2, [3, 4], 8)
        started = time.monotonic()
        [sent1] = wait(rank1)
        [received] = wait(decode)
        assert sent1.ok and time.monotonic() - started >= 0.7  # it wrote, after its delay
        assert not received.ok and "(rank 0): transfer failed (injected" in received.error
        wait(rank0)


def test_tp_sizes_that_do_not_divide_are_refused_with_a_clear_message() -> None:
    with instances("fake", 6, 2, 3) as pd:
        pd.recv(3, [1], 3)
        for decode in pd.decodes:
            [received] = wait(decode)
            assert not received.ok
            assert "tensor-parallel size mismatch: the prefill instance has 2 ranks, the " \
                   "decode instance 3" in received.error
            assert "--tensor-parallel-size" in received.error
        assert not any(t.any() for c in pd.decode_caches for t in c.values())
        # Every prefill rank hears of it, so a send it plans for the room ends at once.
        deadline = time.monotonic() + 5
        while not all(3 in p.rooms for p in pd.prefills):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pd.send(3, [1], 3)
        for prefill in pd.prefills:
            [sent] = wait(prefill, timeout_s=2)
            assert not sent.ok and "tensor-parallel size mismatch" in sent.error
