"""Prefill/decode disaggregation through two whole engines in one process (the PDConnector
on each, real bootstrap server, real sockets, both transfer backends), stepped in turn: the
decode instance continues from the prefill's first token without recomputing the prompt, so
greedy (and seeded) output, logprobs included, equals one colocated engine, also from a TP = 1
prefill into a TP = 2 decode (each decode rank gets its heads); and every fault ends in a clean
error or a local recompute, with every block back on both sides. (A TP = 2 prefill into a
TP = 1 decode, through real servers and the router: tests/server/test_disagg_hetero_tp.py.)"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from sluice import LLM, SamplingParams
from sluice.kv_transfer.disagg.poll import KVPoll
from tests.connectors import count_computed_tokens
from tests.kv_transfer.test_disagg_transfer import require_backend

pytestmark = pytest.mark.serial

BLOCK = 8
ENGINE = dict(dtype="float32", block_size=BLOCK, max_model_len=256, seed=0, device="cpu")


def pd_config(role: str, backend: str = "fake", **extra: object) -> dict:
    config = {"kv_connector": "PDConnector", "kv_role": role,
              "kv_connector_extra_config": {"transfer_backend": backend, "bootstrap_port": 0,
                                            "heartbeat_interval_s": 0.2,
                                            "heartbeat_misses": 2, **extra}}
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = extra.pop("policy", "fail")
        config["kv_connector_extra_config"].pop("policy", None)
    return config


class Pair:
    """A prefill and a decode engine, and the loop that steps both."""

    def __init__(self, model: str, backend: str = "fake", prefill_extra: dict | None = None,
                 decode_extra: dict | None = None, decode_engine: dict | None = None,
                 **engine: object) -> None:
        self.prefill = LLM(model=model, kv_transfer_config=pd_config(
            "kv_producer", backend, **(prefill_extra or {})), **{**ENGINE, **engine})
        connector = self.prefill.llm_engine.scheduler.connector
        self.bootstrap_port = connector.bootstrap_server.port
        self.decode = LLM(model=model, kv_transfer_config=pd_config(
            "kv_consumer", backend, **(decode_extra or {})), **{**ENGINE,
                                                                **(decode_engine or {})})
        self.computed = count_computed_tokens(self.decode)
        self.room = 1000

    def add(self, name: str, prompt: list[int], params: SamplingParams, to_prefill: bool = True
            ) -> int:
        self.room += 1
        if to_prefill:
            self.prefill.llm_engine.add_request(
                f"p-{name}", {"prompt_token_ids": prompt}, params,
                kv_transfer_params={"do_remote_decode": True, "bootstrap_room": self.room})
        self.decode.llm_engine.add_request(
            name, {"prompt_token_ids": prompt}, params, kv_transfer_params={
                "do_remote_prefill": True, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.bootstrap_port, "bootstrap_room": self.room})
        return self.room

    def run(self, timeout_s: float = 30.0) -> dict:
        """Step both until every request is done; returns the decode's finished outputs by
        name."""
        finished = {}
        deadline = time.monotonic() + timeout_s
        engines = [self.prefill.llm_engine, self.decode.llm_engine]
        while any(e.engine_core.has_unfinished_requests() for e in engines if e is not None):
            assert time.monotonic() < deadline, "PD requests never finished"
            for engine in engines:
                if engine is None:
                    continue
                for output in engine.step():
                    if output.finished and engine is self.decode.llm_engine:
                        finished[output.request_id] = output
            time.sleep(0.002)
        return finished

    def assert_all_blocks_back(self) -> None:
        for llm in (self.prefill, self.decode):
            manager = llm.llm_engine.kv_cache_manager
            manager.check_integrity()
            assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1
            llm.llm_engine.scheduler.connector.check_integrity()

    def stats(self, llm: LLM) -> dict[str, float]:
        return llm.llm_engine.scheduler.connector.get_stats()

    def shutdown(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()


@pytest.fixture(scope="module")
def reference(qwen3_dir: str) -> Iterator[LLM]:
    llm = LLM(model=qwen3_dir, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture
def make_pair(qwen3_dir: str) -> Iterator:
    pairs: list[Pair] = []

    def make(**kwargs: object) -> Pair:
        pairs.append(Pair(qwen3_dir, **kwargs))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.shutdown()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 400) for _ in range(n)] for n in lengths]


def expected(reference: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list:
    return [reference.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
            for p, sp in zip(batch, params)]


def run_and_check(pair: Pair, batch: list[list[int]], params: SamplingParams,
                  want: list) -> None:
    """Each prompt through the pair: the decode's tokens are `want`'s, and it computed no
    prompt token (only each later token's KV, one per step)."""
    for i, prompt in enumerate(batch):
        pair.add(f"r{i}", prompt, params)
    got = pair.run()
    for i in range(len(batch)):
        assert got[f"r{i}"].outputs[0].token_ids == want[i].token_ids, f"request {i}"
        assert pair.computed[f"r{i}"] == params.max_tokens - 1  # no prompt recomputed


@pytest.mark.parametrize("backend", ["fake", "mooncake"])
def test_decode_continues_from_the_prefills_first_token_exactly_as_colocated(
        make_pair, reference: LLM, backend: str) -> None:
    require_backend(backend)
    # Shorter than a block, a block exactly, one token past one, several blocks.
    batch = prompts(1, [3, 8, 9, 16, 37, 64])
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    want = expected(reference, batch, params)
    pair = make_pair(backend=backend)
    for i, (prompt, sp) in enumerate(zip(batch, params)):
        pair.add(f"r{i}", prompt, sp)
    got = pair.run()
    for i, (sp, reference_output) in enumerate(zip(params, want)):
        output = got[f"r{i}"].outputs[0]
        assert output.token_ids == reference_output.token_ids, f"request {i}"
        assert output.finish_reason == "length"
        if sp.logprobs:
            for ours, theirs in zip(output.logprobs, reference_output.logprobs):
                assert ours.keys() == theirs.keys()
                for token_id in ours:
                    assert ours[token_id].logprob == pytest.approx(theirs[token_id].logprob,
                                                                   abs=1e-5)
        # The decode never computed the prompt: only each later token's KV, one per step.
        assert pair.computed[f"r{i}"] == sp.max_tokens - 1
    stats = pair.stats(pair.decode)
    assert stats["worker_rooms_received"] == len(batch)
    assert stats["worker_received_blocks"] == sum(-(-len(p) // BLOCK) for p in batch)
    pair.assert_all_blocks_back()


@pytest.mark.parametrize("backend", ["fake", "mooncake"])
def test_an_fp8_cache_moves_as_bytes_and_decodes_exactly_as_colocated_fp8(
        make_pair, qwen3_dir: str, backend: str) -> None:
    """Both instances with 8-bit caches: the blocks move byte for byte (their values are not
    what a float32 cache would hold), and the output is one fp8 engine's."""
    require_backend(backend)
    batch = prompts(11, [9, 37, 64])
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    colocated = LLM(model=qwen3_dir, **{**ENGINE, "kv_cache_dtype": "fp8"})
    want = expected(colocated, batch, [params] * len(batch))
    colocated.shutdown()
    pair = make_pair(backend=backend, kv_cache_dtype="fp8",
                     decode_engine={"kv_cache_dtype": "fp8"})
    run_and_check(pair, batch, params, want)
    assert pair.stats(pair.decode)["worker_received_blocks"] == sum(
        -(-len(p) // BLOCK) for p in batch)
    pair.assert_all_blocks_back()


def test_a_tp1_prefill_feeds_a_tp2_decode_exactly_as_colocated(make_pair,
                                                              reference: LLM) -> None:
    batch = prompts(8, [5, 16, 37, 64])
    longer = batch[3] + prompts(9, [20])[0]  # its first 8 blocks are the 64-token prompt's
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = expected(reference, [*batch, longer], [params] * 5)
    pair = make_pair(decode_engine={"tensor_parallel_size": 2})
    run_and_check(pair, batch, params, want)
    pair.add("longer", longer, params)
    assert pair.run()["longer"].outputs[0].token_ids == want[4].token_ids
    stats = pair.stats(pair.decode)
    assert stats["local_hit_blocks"] == 8  # from the decode's own prefix cache
    # Both decode ranks received every room (each its head of the one prefill rank's two).
    assert stats["worker_rooms_received"] == 2 * 5
    assert pair.stats(pair.prefill)["worker_rooms_sent"] == 5
    pair.assert_all_blocks_back()


def test_decode_asks_only_for_the_blocks_its_prefix_cache_lacks(make_pair,
                                                                  reference: LLM) -> None:
    first, longer = prompts(2, [40, 30])
    longer = first + longer  # the first 5 blocks are a prefix of it
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = expected(reference, [first, longer], [params, params])
    pair = make_pair()
    pair.add("first", first, params)
    assert pair.run()["first"].outputs[0].token_ids == want[0].token_ids
    pair.add("longer", longer, params)
    output = pair.run()["longer"]
    assert output.outputs[0].token_ids == want[1].token_ids
    stats = pair.stats(pair.decode)
    # 70 tokens: 9 blocks, the first 5 found in the decode's own prefix cache.
    assert stats["local_hit_blocks"] == 5
    assert stats["requested_blocks"] == 5 + 9 - 5
    sent = pair.stats(pair.prefill)  # in the room's write, or layer by layer before it
    assert sent.get("worker_sent_blocks", 0) + sent.get("worker_streamed_blocks", 0) == 5 + 4
    pair.assert_all_blocks_back()


def test_a_first_token_that_ends_the_request_ends_it_on_the_decode_side(
        make_pair, reference: LLM) -> None:
    [prompt] = prompts(3, [20])
    greedy = reference.generate([{"prompt_token_ids": prompt}],
                                SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = greedy[0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first])
    pair = make_pair()
    pair.add("stops", prompt, params)
    output = pair.run()["stops"].outputs[0]
    assert output.token_ids == [first] and output.finish_reason == "stop"
    assert output.stop_reason == first
    assert pair.computed["stops"] == 0  # ended before any step on the decode side
    pair.assert_all_blocks_back()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_transfer_is_an_error_before_the_first_token_or_a_local_recompute(
        make_pair, reference: LLM, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    monkeypatch.setenv("SLUICE_PD_FAULT_TRANSFER_FAIL_PROB", "1")
    [prompt] = prompts(4, [30])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    pair = make_pair(decode_extra={"policy": policy})
    pair.add("doomed", prompt, params)
    output = pair.run()["doomed"].outputs[0]
    if policy == "fail":
        assert output.token_ids == [] and output.finish_reason == "error"
        assert "PD transfer failed" in output.stop_reason and "injected" in output.stop_reason
    else:  # the decode instance computes the prompt itself
        assert output.token_ids == expected(reference, [prompt], [params])[0].token_ids
        assert pair.computed["doomed"] == 30 + 4
    pair.assert_all_blocks_back()


def test_a_lost_prefill_fails_the_decode_request_within_the_heartbeat_bound(
        make_pair) -> None:
    [prompt] = prompts(5, [30])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    pair = make_pair()
    pair.add("orphan", prompt, params, to_prefill=False)  # the prefill never gets it
    for _ in range(50):  # let the decode ask
        pair.decode.llm_engine.step()
        time.sleep(0.01)
    pair.prefill.shutdown()  # its bootstrap server and KV manager are gone
    lost = time.monotonic()
    prefill, pair.prefill = pair.prefill, None
    try:
        output = _run_decode(pair, "orphan")
    finally:
        pair.prefill = prefill
    bound = pair.decode.llm_engine.scheduler.connector.pd.heartbeat_bound_s
    assert time.monotonic() - lost <= bound + 0.5
    assert output.outputs[0].finish_reason == "error"
    assert "lost" in output.outputs[0].stop_reason
    manager = pair.decode.llm_engine.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1


def _run_decode(pair: Pair, name: str, timeout_s: float = 10.0):  # noqa: ANN202
    engine = pair.decode.llm_engine
    deadline = time.monotonic() + timeout_s
    while engine.engine_core.has_unfinished_requests():
        assert time.monotonic() < deadline
        for output in engine.step():
            if output.finished and output.request_id == name:
                result = output
        time.sleep(0.002)
    return result


def test_an_abort_mid_transfer_frees_every_block_on_both_sides(
        make_pair, reference: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_PD_FAULT_SEND_DELAY_S", "0.5")
    doomed, other = prompts(6, [50, 20])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pair = make_pair()
    pair.add("doomed", doomed, params)
    deadline = time.monotonic() + 10
    while pair.stats(pair.prefill).get("send_rooms", 0) < 1:  # prefill done, write delayed
        assert time.monotonic() < deadline
        pair.prefill.llm_engine.step()
        pair.decode.llm_engine.step()
    pair.decode.llm_engine.abort_request("doomed")
    pair.add("other", other, params)  # runs meanwhile, in other blocks
    got = pair.run()
    assert got["other"].outputs[0].token_ids == expected(reference, [other],
                                                          [params])[0].token_ids
    assert pair.stats(pair.prefill)["worker_rooms_failed"] == 1
    pair.assert_all_blocks_back()


def test_a_decode_request_that_never_receives_lets_the_prefill_free_its_blocks_at_once(
        make_pair, reference: LLM) -> None:
    # prompt_logprobs need every prompt position's logits: the decode computes the prompt
    # itself, never asks for the room, and says so, so the prefill need not wait out its lease.
    [prompt] = prompts(7, [40])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    pair = make_pair(prefill_extra={"send_lease_s": 60.0})
    pair.add("local", prompt, params)
    started = time.monotonic()
    output = pair.run(timeout_s=10)["local"]
    assert output.outputs[0].token_ids == expected(reference, [prompt], [params])[0].token_ids
    assert pair.computed["local"] == 40 + 3
    assert time.monotonic() - started < 5
    pair.assert_all_blocks_back()


def _asked(pair: Pair, room: int, timeout_s: float = 10.0) -> None:
    """Step the decode until the prefill rank has its ask for `room`."""
    worker = pair.prefill.llm_engine.engine_core.executor.worker
    manager = worker.model_runner.kv_connector.manager
    deadline = time.monotonic() + timeout_s
    while manager.poll(room) != KVPoll.WaitingForInput:
        assert time.monotonic() < deadline, f"room {room} was never asked for"
        pair.decode.llm_engine.step()
        time.sleep(0.005)


@pytest.mark.parametrize(("backend", "layerwise"), [("fake", True), ("mooncake", True),
                                                     ("shm", True), ("fake", False)])
def test_layerwise_sends_every_block_during_the_prompts_steps_and_output_is_unchanged(
        make_pair, reference: LLM, backend: str, layerwise: bool) -> None:
    """Chunked prompts (16-token steps) and the prefill's prefix cache: with the decode's ask
    in before the prompt computes, every block goes out layer by layer inside the prompt's
    steps, the room's write after it sends none, and the output is colocated greedy's. Off,
    every block goes in the room's write."""
    require_backend(backend)
    base, tail = prompts(12, [40, 27])
    batch = [base, base + tail, prompts(13, [9])[0]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = expected(reference, batch, [params] * len(batch))
    pair = make_pair(backend=backend, prefill_extra={"layerwise": layerwise},
                     max_num_batched_tokens=16)
    num_layers = pair.prefill.llm_engine.scheduler.connector.kv_cache_spec.num_layers
    for i, prompt in enumerate(batch):
        room = pair.add(f"r{i}", prompt, params, to_prefill=False)
        _asked(pair, room)
        pair.prefill.llm_engine.add_request(
            f"p-r{i}", {"prompt_token_ids": prompt}, params,
            kv_transfer_params={"do_remote_decode": True, "bootstrap_room": room})
        output = pair.run()[f"r{i}"].outputs[0]
        assert output.token_ids == want[i].token_ids, f"request {i}"
        assert pair.computed[f"r{i}"] == params.max_tokens - 1  # no prompt recomputed
    sent = pair.stats(pair.prefill)
    decode = pair.stats(pair.decode)
    # The decode's own cache had the first request's 5 blocks for the second.
    assert decode["local_hit_blocks"] == 5
    num_blocks = decode["requested_blocks"]
    assert num_blocks == 5 + (9 - 5) + 2
    assert sent["worker_rooms_sent"] == 3
    if layerwise:
        assert sent["worker_streamed_blocks"] == num_blocks
        assert sent.get("worker_sent_blocks", 0) == 0
        assert sent["worker_rooms_streamed"] == 3
        # Every chunk's layers, each its own write: 40 tokens in 3 chunks, the 27 past the
        # prefill's own prefix hit in 2, 9 in 1.
        assert sent["worker_layer_writes"] == (3 + 2 + 1) * num_layers
    else:
        assert sent["worker_sent_blocks"] == num_blocks
        assert "worker_layer_writes" not in sent and "worker_rooms_streamed" not in sent
    pair.assert_all_blocks_back()


def test_the_bootstrap_queue_holds_each_prompt_until_its_decode_asks_so_every_block_streams(
        make_pair, reference: LLM) -> None:
    """Both halves added at once, the prefill's first (as the router sends them): the prefill
    holds each prompt until the decode asked for its room, so each is computed with its decode
    known and every block goes out layer by layer; output equal colocated greedy's."""
    batch = prompts(21, [40, 17, 33])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = expected(reference, batch, [params] * len(batch))
    pair = make_pair(max_num_batched_tokens=16)
    run_and_check(pair, batch, params, want)
    sent = pair.stats(pair.prefill)
    assert sent["bootstrap_held"] == 3 and "bootstrap_wait_expired" not in sent
    assert sent["bootstrap_holding"] == 0
    assert sent["worker_rooms_streamed"] == 3 and sent.get("worker_sent_blocks", 0) == 0
    pair.assert_all_blocks_back()


def test_prompts_shorter_than_bootstrap_wait_min_tokens_are_not_held(
        make_pair, reference: LLM) -> None:
    """With bootstrap_wait_min_tokens 30, the prompts of 40 and 33 tokens wait for their
    decode's ask and the one of 17 computes at once; output equal colocated greedy's."""
    batch = prompts(21, [40, 17, 33])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = expected(reference, batch, [params] * len(batch))
    pair = make_pair(max_num_batched_tokens=16, prefill_extra={"bootstrap_wait_min_tokens": 30})
    run_and_check(pair, batch, params, want)
    sent = pair.stats(pair.prefill)
    assert sent["bootstrap_held"] == 2 and "bootstrap_wait_expired" not in sent
    assert sent["send_rooms"] == 3
    pair.assert_all_blocks_back()


@pytest.mark.parametrize("wait_s", [0.3, 0.0])
def test_a_prompt_whose_decode_has_not_asked_computes_after_the_bootstrap_wait(
        make_pair, reference: LLM, wait_s: float) -> None:
    """No ask within bootstrap_wait_s (0: no wait at all): the prefill computes the prompt
    anyway, after about that long and while another request computes at once, and when the
    decode asks later the room's write sends every block; output unchanged."""
    base, plain = prompts(22, [30, 12])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = expected(reference, [base], [params])
    pair = make_pair(prefill_extra={"bootstrap_wait_s": wait_s})
    engine = pair.prefill.llm_engine
    started = time.monotonic()
    engine.add_request("p-late", {"prompt_token_ids": base}, params,
                       kv_transfer_params={"do_remote_decode": True, "bootstrap_room": 77})
    engine.add_request("plain", {"prompt_token_ids": plain}, SamplingParams(max_tokens=2))
    plain_done = None
    while engine.scheduler.connector.get_stats().get("send_rooms", 0) < 1:
        assert time.monotonic() - started < 10, "the held prompt never computed"
        for output in engine.step():
            if output.request_id == "plain" and output.finished:
                plain_done = time.monotonic() - started
        time.sleep(0.002)
    held_s = time.monotonic() - started
    if wait_s:
        assert plain_done is not None and plain_done < held_s  # not held behind it
    assert wait_s <= held_s < wait_s + 3
    sent = pair.stats(pair.prefill)
    assert sent.get("bootstrap_wait_expired", 0) == (1 if wait_s else 0)
    pair.decode.llm_engine.add_request(
        "late", {"prompt_token_ids": base}, params, kv_transfer_params={
            "do_remote_prefill": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": pair.bootstrap_port, "bootstrap_room": 77})
    assert pair.run()["late"].outputs[0].token_ids == want[0].token_ids
    sent = pair.stats(pair.prefill)
    assert sent["worker_sent_blocks"] == -(-len(base) // BLOCK)
    assert "worker_rooms_streamed" not in sent
    pair.assert_all_blocks_back()


def test_polling_steps_are_taken_at_once_and_a_finished_send_goes_without_a_wait(
        make_pair, reference: LLM) -> None:
    """With async scheduling, a step of no tokens (the engine polling its workers for a
    transfer) is taken at once, not left in flight: else the busy loop never waits, and holds
    the GIL from the KV managers' threads. A prefill request that finished leaves its send
    planned, and the engine steps for it at once (has_requests_to_schedule) rather than after
    its wait for input."""
    batch = prompts(5, [40])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = expected(reference, batch, [params])
    pair = make_pair(async_scheduling=True, decode_engine={"async_scheduling": True})
    decode = pair.decode.llm_engine.engine_core
    prefill = pair.prefill.llm_engine.engine_core
    assert decode.async_scheduling and prefill.async_scheduling
    pair.add("r0", batch[0], params, to_prefill=False)
    for _ in range(5):  # parked: its prefill half has not come
        pair.decode.llm_engine.step()
        assert decode.in_flight is None
        assert not decode.scheduler.has_requests_to_schedule()
    pair.prefill.llm_engine.add_request(
        "p-r0", {"prompt_token_ids": batch[0]}, params,
        kv_transfer_params={"do_remote_decode": True, "bootstrap_room": pair.room})
    planned = False
    deadline = time.monotonic() + 30
    while not planned:
        assert time.monotonic() < deadline, "the prefill request never finished"
        pair.prefill.llm_engine.step()
        connector = prefill.scheduler.connector
        planned = bool(connector._plan.sends)
    assert prefill.scheduler.has_requests_to_schedule()  # the loop would not wait
    got = pair.run()
    assert got["r0"].outputs[0].token_ids == want[0].token_ids
    pair.assert_all_blocks_back()


def test_a_wakeup_ends_the_engine_loops_wait() -> None:
    """A KV manager's thread (a room's status, a decode's ask) wakes the engine core's busy
    loop out of its wait for input through wakeup.py's eventfd."""
    import threading

    import zmq

    from sluice.engine import wakeup

    poller = zmq.Poller()
    poller.register(wakeup.fd(), zmq.POLLIN)
    wakeup.drain()
    assert not poller.poll(10)
    timer = threading.Timer(0.05, wakeup.notify)
    started = time.monotonic()
    timer.start()
    assert poller.poll(5000)
    assert time.monotonic() - started < 2.0
    wakeup.drain()
    assert not poller.poll(10)  # drained: the next wait waits


def test_a_received_first_token_goes_out_when_its_report_is_launched_not_a_step_later(
        make_pair, reference: LLM) -> None:
    """With async scheduling and a request decoding, the step in flight is taken one step
    later; the report of a finished load is known at the step's launch (in-process workers),
    so the first token it brought goes out in the engine step that launched it (one decode
    step sooner), and the output stays the colocated one."""
    batch = prompts(6, [30, 40])
    busy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = expected(reference, batch, [busy, params])
    pair = make_pair(async_scheduling=True, decode_engine={"async_scheduling": True})
    decode = pair.decode.llm_engine
    core = decode.engine_core
    executor = core.executor
    launch = executor.execute_model
    reported: list[set[str]] = []

    def execute_model(scheduler_output):  # noqa: ANN001, ANN202
        handle = launch(scheduler_output)
        report = handle.output.kv_connector_output
        reported.append(set() if report is None else set(report.first_tokens))
        return handle

    executor.execute_model = execute_model
    pair.add("busy", batch[0], busy)
    deadline = time.monotonic() + 30
    while not decode.has_unfinished_requests() or core.in_flight is None:
        assert time.monotonic() < deadline, "the first request never started decoding"
        pair.prefill.llm_engine.step()
        decode.step()
    pair.add("late", batch[1], params)
    first_seen = None
    got = {}
    while first_seen is None:
        assert time.monotonic() < deadline, "the second request's first token never came"
        pair.prefill.llm_engine.step()
        reported.clear()
        for output in decode.step():
            if output.request_id == "late" and output.outputs[0].token_ids:
                first_seen = any("late" in r for r in reported)
    assert core.in_flight is not None  # the busy request kept its steps in flight
    assert first_seen, "the first token waited for the step that reported it to finish"
    got = pair.run()
    assert got["late"].outputs[0].token_ids == want[1].token_ids
    assert got["busy"].outputs[0].token_ids == want[0].token_ids
    pair.assert_all_blocks_back()
