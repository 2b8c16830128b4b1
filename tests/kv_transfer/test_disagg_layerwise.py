"""Layer-wise PD sends without an engine: a prefill rank's KVManager driven as its worker drives
it in a step (begin_layer_sends, send_layer per stored layer, wait_layer_sends), moving real
bytes into a decode rank's cache over every backend. Each layer's blocks land while later
layers are still to be computed; a chunked prompt re-sends only its unfinished block; the room's
status (and so the decode's first token) waits for every layer of every block; an abort or a
dead decode mid-stream ends in a failed room on both sides, never a hang."""

from __future__ import annotations

import time

import pytest

from sluice.config import KVTransferConfig
from sluice.kv_transfer.disagg.config import PDConfig
from sluice.kv_transfer.disagg.connector import LayerSendPlan
from sluice.kv_transfer.disagg.poll import KVPoll
from tests.kv_transfer.test_disagg_transfer import BACKENDS, Pair, blocks_equal, pd_pair

pytestmark = pytest.mark.serial


def wait_until(condition, timeout_s: float = 10.0, what: str = "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def layer_equal(pair: Pair, layer: str, src: list[int], dst: list[int]) -> bool:
    return bool((pair.p_caches[layer][:, src] == pair.d_caches[layer][:, dst]).all())


def layer_untouched(pair: Pair, layer: str, dst: list[int]) -> bool:
    return not pair.d_caches[layer][:, dst].any()


def asked(pair: Pair, room: int) -> None:
    """The decode rank's ask is in at the prefill (the prompt may now stream to it)."""
    wait_until(lambda: pair.prefill.poll(room) == KVPoll.WaitingForInput, what="no ask")


def step(pair: Pair, plan: LayerSendPlan, between_layers=None) -> None:  # noqa: ANN001
    """One prefill step: layers stored in order, each handed over as it is."""
    pair.prefill.begin_layer_sends([plan])
    for layer in range(len(pair.p_caches)):
        pair.prefill.send_layer(layer, None)
        if between_layers is not None:
            between_layers(layer)
    pair.prefill.wait_layer_sends()


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_layer_lands_before_the_next_is_stored_and_the_room_write_sends_only_the_status(
        backend: str) -> None:
    # A 10-token prompt at block size 4 in two chunks (7 tokens, then 3); the decode has block
    # 0 from its own prefix cache and asks for blocks 1 and 2.
    src, dst = [3, 4, 5], [9, 10, 11]
    with pd_pair(backend) as pair:
        pair.decode.receiver(7).init("d", pair.server.address, dst[1:], first_block=1,
                                     num_prompt_tokens=10)
        asked(pair, 7)

        def landed_alone(layer: int) -> None:
            # Layer 0's blocks arrive while layer 1 is not yet stored: during the step.
            if layer == 0:
                wait_until(lambda: layer_equal(pair, "layer.0", src[1:2], dst[1:2]))
                assert layer_untouched(pair, "layer.1", dst)

        step(pair, LayerSendPlan(room=7, block_ids=src[:2], num_complete_blocks=1,
                                 num_prompt_tokens=10), landed_alone)
        assert blocks_equal(pair, src[1:2], dst[1:2])
        assert layer_untouched(pair, "layer.0", dst[:1])  # the decode's own: never written
        assert pair.decode.poll(7) != KVPoll.Success  # no status before the room's write
        # The second chunk writes the rest of block 1 and block 2: both go again.
        for cache in pair.p_caches.values():
            cache[:, src[1]] += 1.0
        step(pair, LayerSendPlan(room=7, block_ids=src, num_complete_blocks=3,
                                 num_prompt_tokens=10))
        stats = pair.prefill.take_stats()
        assert stats["layer_writes"] == 2 * 2  # 2 steps x 2 layers
        assert pair.decode.take_finished() == []
        pair.prefill.sender(7).send("p", src, 10, first_token=5, first_logprobs=None)
        [received] = pair.wait(pair.decode)
        [sent] = pair.wait(pair.prefill)
        assert received.ok and received.first_token == 5 and sent.ok
        assert blocks_equal(pair, src[1:], dst[1:])
        stats = pair.prefill.take_stats()
        assert stats["rooms_streamed"] == 1 and stats["rooms_sent"] == 1
        assert stats.get("sent_blocks", 0) == 0  # nothing was left for the room's write


def test_an_ask_that_comes_mid_prompt_gets_every_earlier_block_with_the_next_step() -> None:
    src, dst = [1, 2, 3], [4, 5, 6]
    with pd_pair("fake") as pair:
        # Step 1 runs before the decode asked: nothing to send it.
        step(pair, LayerSendPlan(room=8, block_ids=src[:1], num_complete_blocks=1,
                                 num_prompt_tokens=12))
        assert "layer_writes" not in pair.prefill.take_stats()
        pair.decode.receiver(8).init("d", pair.server.address, dst, 0, num_prompt_tokens=12)
        asked(pair, 8)
        step(pair, LayerSendPlan(room=8, block_ids=src[:2], num_complete_blocks=2,
                                 num_prompt_tokens=12))
        assert blocks_equal(pair, src[:2], dst[:2])
        assert layer_untouched(pair, "layer.0", dst[2:])
        # The last block was never streamed: the room's write sends it, then the status.
        pair.prefill.sender(8).send("p", src, 12, first_token=2, first_logprobs=None)
        [received] = pair.wait(pair.decode)
        assert received.ok and blocks_equal(pair, src, dst)
        stats = pair.prefill.take_stats()
        assert stats["layer_writes"] == 2 and stats["sent_blocks"] == 1
        assert "rooms_streamed" not in stats


@pytest.mark.parametrize("ask_after_layer", [0, 1])
def test_an_ask_that_comes_mid_step_joins_it_with_every_layer_stored_so_far(
        ask_after_layer: int) -> None:
    """A one-step prompt whose decode asks once layer `ask_after_layer` is stored (1: the last,
    so it joins at the step's end): every layer streams within the step, and the room's write
    sends only the status."""
    src, dst = [1, 2], [6, 7]
    with pd_pair("fake") as pair:
        def ask_now(layer: int) -> None:
            if layer == ask_after_layer:
                pair.decode.receiver(9).init("d", pair.server.address, dst, 0,
                                             num_prompt_tokens=8)
                asked(pair, 9)

        step(pair, LayerSendPlan(room=9, block_ids=src, num_complete_blocks=2,
                                 num_prompt_tokens=8), ask_now)
        assert blocks_equal(pair, src, dst)
        stats = pair.prefill.take_stats()
        assert stats["layer_writes"] == 2 and stats["layer_late_joins"] == 1
        pair.prefill.sender(9).send("p", src, 8, first_token=3, first_logprobs=None)
        [received] = pair.wait(pair.decode)
        assert received.ok and received.first_token == 3
        stats = pair.prefill.take_stats()
        assert stats["rooms_streamed"] == 1 and stats.get("sent_blocks", 0) == 0


class DeviceEvent:
    """A stored layer's event as the device gives it: done once `done_at` (monotonic) has
    passed; set by the test."""

    def __init__(self) -> None:
        self.done_at = float("inf")

    def query(self) -> bool:
        return time.monotonic() >= self.done_at

    def synchronize(self) -> None:
        while not self.query():
            time.sleep(0.001)


@pytest.mark.parametrize("decode_asks", [True, False])
def test_a_step_launched_before_its_decode_asked_takes_the_ask_until_its_last_layer_is_computed(
        decode_asks: bool) -> None:
    """The host reaches a step's end when its last layer is launched, while the device still
    computes it. An ask that comes in between joins the step's layer writes (the room's write
    then sends only the status); with no ask, the step's end waits only until the last layer is
    computed, and the room's write sends every block."""
    import threading

    src, dst = [1, 2], [6, 7]
    with pd_pair("fake") as pair:
        events = [DeviceEvent() for _ in pair.p_caches]
        plan = LayerSendPlan(room=11, block_ids=src, num_complete_blocks=2, num_prompt_tokens=8)
        pair.prefill.begin_layer_sends([plan])
        for layer, event in enumerate(events):
            pair.prefill.send_layer(layer, event)

        def device_then_ask() -> None:
            time.sleep(0.1)
            if decode_asks:
                pair.decode.receiver(11).init("d", pair.server.address, dst, 0,
                                              num_prompt_tokens=8)
                asked(pair, 11)
            time.sleep(0.2)
            for event in events:
                event.done_at = time.monotonic()

        thread = threading.Thread(target=device_then_ask)
        start = time.monotonic()
        thread.start()
        pair.prefill.wait_layer_sends()
        waited = time.monotonic() - start
        thread.join()
        assert 0.25 < waited < 5.0  # until the last layer was computed, not for ever
        stats = pair.prefill.take_stats()
        assert stats["layer_ask_waits"] == 1
        if decode_asks:
            assert stats["layer_writes"] == 2 and blocks_equal(pair, src, dst)
        else:
            assert "layer_writes" not in stats
            pair.decode.receiver(11).init("d", pair.server.address, dst, 0, num_prompt_tokens=8)
        pair.prefill.sender(11).send("p", src, 8, first_token=3, first_logprobs=None)
        [received] = pair.wait(pair.decode)
        assert received.ok and blocks_equal(pair, src, dst)
        stats = pair.prefill.take_stats()
        if decode_asks:
            assert stats["rooms_streamed"] == 1 and stats.get("sent_blocks", 0) == 0
        else:
            assert stats["sent_blocks"] == 2


def test_a_decode_abort_mid_prompt_fails_the_room_on_both_sides() -> None:
    with pd_pair("fake") as pair:
        pair.decode.receiver(9).init("d", pair.server.address, [4, 5], 0, 8)
        asked(pair, 9)
        pair.prefill.begin_layer_sends([LayerSendPlan(9, [1], 1, 8)])
        pair.prefill.send_layer(0, None)
        pair.decode.receiver(9).abort("client gone")
        wait_until(lambda: pair.prefill.poll(9) == KVPoll.Failed, what="abort not seen")
        pair.prefill.send_layer(1, None)  # stops: the room is over
        started = time.monotonic()
        pair.prefill.wait_layer_sends()
        assert time.monotonic() - started < 5
        # The request's end finds the room failed: its blocks are freed at once.
        pair.prefill.sender(9).send("p", [1, 2], 8, first_token=3, first_logprobs=None)
        [sent] = pair.wait(pair.prefill)
        [received] = pair.wait(pair.decode)
        assert not sent.ok and "decode aborted the room" in sent.error
        assert not received.ok
        assert layer_untouched(pair, "layer.1", [4, 5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_that_dies_mid_prompt_fails_the_room_within_the_write_bounds(
        backend: str) -> None:
    with pd_pair(backend) as pair:
        pair.decode.receiver(10).init("d", pair.server.address, [4, 5], 0, 8)
        asked(pair, 10)
        pair.decode.shutdown()
        started = time.monotonic()
        step(pair, LayerSendPlan(10, [1], 1, 8))  # bounded by the write (fake: a 10 s ack)
        assert time.monotonic() - started < 15
        stats = pair.prefill.take_stats()
        assert stats["layer_write_errors"] == 1  # the first; the step's rest stop at once
        assert "layer_writes" not in stats
        # The room's write probes the suspect peer, finds it gone, and fails the room.
        pair.prefill.sender(10).send("p", [1, 2], 8, first_token=3, first_logprobs=None)
        [sent] = pair.wait(pair.prefill, timeout_s=15)
        assert not sent.ok and sent.error, sent


def test_layerwise_is_a_boolean_setting_on_by_default() -> None:
    def config(**extra: object) -> PDConfig:
        return PDConfig.from_kv_transfer_config(KVTransferConfig(
            kv_connector="PDConnector", kv_role="kv_producer", kv_connector_extra_config=extra))

    assert config().layerwise is True
    assert config(layerwise=False).layerwise is False
    with pytest.raises(ValueError, match="layerwise must be true or false, got 'no'"):
        config(layerwise="no")
