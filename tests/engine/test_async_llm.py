"""AsyncLLM with the engine core in a real spawned process, on the CPU with a tiny model:
outputs equal LLM.generate, streams concatenate, every way a request can end returns its blocks,
bad input never reaches the core, and a dead core fails requests fast and loudly."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from sluice import LLM, SamplingParams
from sluice.channel import Encoder
from sluice.core.request import EngineCoreRequest
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.async_llm import AsyncLLM, EngineDeadError
from sluice.engine.processors import RequestOutputKind
from sluice.engine.stats import IterationStats, SchedulerStats, StatsLogger
from sluice.engine.wire import WIRE_VERSION, AddRequest
from sluice.outputs import RequestOutput

pytestmark = pytest.mark.serial

ENGINE_KWARGS: dict[str, Any] = dict(dtype="float32", block_size=8, max_model_len=256, seed=0)
TIMEOUT_S = 60.0
DELTA, CUMULATIVE, FINAL_ONLY = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                                 RequestOutputKind.FINAL_ONLY)


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = TIMEOUT_S) -> Any:
    """One event loop per test; a hang fails the test instead of the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def start_engine(model_dir: str, **overrides: Any) -> AsyncLLM:
    args = EngineArgs(model=model_dir, **{**ENGINE_KWARGS, **overrides})
    return AsyncLLM.from_engine_args(args, ready_timeout_s=120.0, log_stats=False)


@pytest.fixture(scope="module")
def engine(qwen3_dir: str) -> Iterator[AsyncLLM]:
    llm = start_engine(qwen3_dir)
    yield llm
    llm.shutdown()


@pytest.fixture
def make_engine(qwen3_dir: str) -> Iterator[Callable[..., AsyncLLM]]:
    """Engines a test may kill; each is shut down when the test ends, whatever happened."""
    started: list[AsyncLLM] = []

    def make(**overrides: Any) -> AsyncLLM:
        started.append(start_engine(qwen3_dir, **overrides))
        return started[-1]

    yield make
    for llm in started:
        llm.shutdown()
        assert not llm._process.is_alive()


@pytest.fixture(scope="module")
def reference(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, **ENGINE_KWARGS)


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


async def collect(llm: AsyncLLM, prompt: Any, params: SamplingParams, request_id: str,
                  kind: RequestOutputKind = DELTA) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, params, request_id, kind)]


def merge_deltas(stream: list[RequestOutput]) -> dict[int, dict[str, Any]]:
    merged: dict[int, dict[str, Any]] = {}
    for out in stream:
        for c in out.outputs:
            m = merged.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": []})
            m["text"] += c.text
            m["token_ids"] += c.token_ids
            m["logprobs"] += c.logprobs or []
            m["finish_reason"], m["stop_reason"] = c.finish_reason, c.stop_reason
            m["cumulative_logprob"] = c.cumulative_logprob
    return merged


async def assert_all_blocks_back(llm: AsyncLLM, stats: SchedulerStats | None = None) -> None:
    stats = stats or await llm.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_blocks == llm.num_blocks
    assert await llm.call_utility("check_integrity") is True
    assert not llm.output_processor.requests and not llm._streams


def find_stop_string(reference: LLM, prompt: Any) -> tuple[str, str]:
    """A stop string spanning two tokens of the greedy output; returns (stop, full text)."""
    tok = reference.get_tokenizer()
    full = reference.generate([prompt], greedy(24, ignore_eos=True), use_tqdm=False)[0]
    pieces = [tok.decode([t]) for t in full.outputs[0].token_ids]
    for i in range(2, len(pieces) - 1):
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2:
            return pieces[i][-1] + pieces[i + 1][:1], full.outputs[0].text
    pytest.skip("no two consecutive multi-character tokens in this output")


def test_concurrent_streams_equal_llm_generate(engine: AsyncLLM, reference: LLM) -> None:
    stop_prompt = {"prompt_token_ids": list(range(60, 90))}
    stop, stop_full_text = find_stop_string(reference, stop_prompt)
    prompts: list[Any] = [
        "Hello world",
        {"prompt_token_ids": list(range(20, 45))},
        "The quick brown fox",
        stop_prompt,
        {"prompt_token_ids": list(range(30, 52))},
    ]
    params = [
        greedy(12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True),
        SamplingParams(n=3, temperature=0.8, top_k=50, seed=5, max_tokens=10, ignore_eos=True),
        # Far more tokens than the stop string needs: the core must be told to finish.
        greedy(200, ignore_eos=True, stop=[stop]),
        greedy(6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    ]
    expected = reference.generate(prompts, params, use_tqdm=False)
    iterations: list[IterationStats] = []

    def listener(iteration: IterationStats, _stats: SchedulerStats | None) -> None:
        iterations.append(iteration)

    engine.add_stats_listener(listener)

    async def main() -> tuple[list[list[RequestOutput]], SchedulerStats]:
        streams = await asyncio.gather(*(collect(engine, p, sp, f"eq-{i}")
                                         for i, (p, sp) in enumerate(zip(prompts, params))))
        return streams, await engine.get_stats()

    try:
        streams, stats_after = run(main())
    finally:
        engine.stats.remove_listener(listener)
    # The stop-string request was finished in the core as soon as the front end saw the stop.
    assert (stats_after.num_running, stats_after.num_waiting) == (0, 0)

    for want, stream in zip(expected, streams):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        last = stream[-1]
        assert (last.prompt, last.prompt_token_ids) == (want.prompt, want.prompt_token_ids)
        merged = merge_deltas(stream)
        assert sorted(merged) == [c.index for c in want.outputs]
        for c in want.outputs:
            got = merged[c.index]
            assert got["token_ids"] == c.token_ids
            assert got["text"] == c.text
            assert (got["finish_reason"], got["stop_reason"]) == (c.finish_reason, c.stop_reason)
            if c.logprobs is None:
                assert got["logprobs"] == [] and got["cumulative_logprob"] is None
                continue
            assert got["cumulative_logprob"] == pytest.approx(c.cumulative_logprob, abs=1e-4)
            assert [list(p) for p in got["logprobs"]] == [list(p) for p in c.logprobs]
            for got_pos, want_pos in zip(got["logprobs"], c.logprobs):
                for token_id, lp in want_pos.items():
                    assert got_pos[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)
                    assert got_pos[token_id].rank == lp.rank
                    assert got_pos[token_id].decoded_token == lp.decoded_token
        if want.prompt_logprobs is None:
            assert last.prompt_logprobs is None
        else:
            assert last.prompt_logprobs[0] is None
            assert len(last.prompt_logprobs) == len(want.prompt_logprobs)
            for got_pos, want_pos in zip(last.prompt_logprobs[1:], want.prompt_logprobs[1:]):
                assert {t: lp.rank for t, lp in got_pos.items()} == \
                    {t: lp.rank for t, lp in want_pos.items()}
                for t, lp in want_pos.items():
                    assert got_pos[t].logprob == pytest.approx(lp.logprob, abs=1e-4)
    stop_out = merge_deltas(streams[3])[0]
    assert stop_out["finish_reason"] == "stop" and stop_out["stop_reason"] == stop
    assert stop_out["text"] == stop_full_text[:stop_full_text.index(stop)]
    assert len(merge_deltas(streams[2])) == 3

    # What the stats listeners saw: one TTFT per request, every token, every finish.
    finished = {f.request_id: f for it in iterations for f in it.finished_requests}
    assert sorted(finished) == [f"eq-{i}" for i in range(len(prompts))]
    assert sum(len(it.time_to_first_tokens) for it in iterations) == len(prompts)
    num_tokens = sum(len(c.token_ids) for out in expected for c in out.outputs)
    assert sum(it.num_generation_tokens for it in iterations) == num_tokens
    assert sum(it.num_prompt_tokens for it in iterations) == \
        sum(len(out.prompt_token_ids) for out in expected)
    assert len([x for it in iterations for x in it.inter_token_latencies]) > 10
    for i, want in enumerate(expected):
        f = finished[f"eq-{i}"]
        assert f.finish_reason == want.outputs[0].finish_reason
        assert f.num_generation_tokens == sum(len(c.token_ids) for c in want.outputs)
        assert f.num_prompt_tokens == len(want.prompt_token_ids)
        assert 0 <= f.queued_time <= f.e2e_latency
        assert f.e2e_latency == pytest.approx(f.queued_time + f.prefill_time + f.decode_time)
    run(assert_all_blocks_back(engine))


def test_output_kinds_agree_and_delta_streams(engine: AsyncLLM) -> None:
    prompt = "Streaming, one delta at a time"

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine, prompt, greedy(12, ignore_eos=True),
                                              f"kind-{kind.name}", kind)
                                      for kind in (DELTA, CUMULATIVE, FINAL_ONLY)))

    delta, cumulative, final = run(main())
    assert len(final) == 1 and final[0].finished
    assert len(delta) > 1 and len(cumulative) > 1
    final_text = final[0].outputs[0].text
    assert "".join(o.outputs[0].text for o in delta) == final_text
    assert cumulative[-1].outputs[0].text == final_text
    assert sum((o.outputs[0].token_ids for o in delta), []) == final[0].outputs[0].token_ids
    assert len(final[0].outputs[0].token_ids) == 12
    for before, after in zip(cumulative, cumulative[1:]):
        assert after.outputs[0].text.startswith(before.outputs[0].text)
        assert after.outputs[0].token_ids[:len(before.outputs[0].token_ids)] == \
            before.outputs[0].token_ids


@pytest.mark.parametrize("n", [1, 2])
def test_a_caller_that_falls_behind_gets_the_missed_steps_merged(engine: AsyncLLM, n: int
                                                                  ) -> None:
    """A DELTA caller that takes nothing while its request runs to the end gets everything it
    missed as one output: the same text, token ids and logprobs as the steps one by one."""
    prompt = "A caller that falls behind"
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, n=n)

    async def behind() -> list[RequestOutput]:
        stream = engine.generate(prompt, params, f"behind-{n}")
        outputs = [await anext(stream)]
        while f"behind-{n}" in engine.output_processor.requests:  # runs on without us
            await asyncio.sleep(0.01)
        return outputs + [out async for out in stream]

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        slow = await behind()
        # The reference takes every step as it comes; on a loaded machine (the test suite's
        # other half beside it) even it can fall behind a step and get two merged: again then.
        for attempt in range(3):
            steps = await collect(engine, prompt, params, f"steps-{n}-{attempt}")
            if len(steps) > 2:
                break
        return slow, steps

    slow, steps = run(main())
    assert len(slow) == 2 and slow[-1].finished and not slow[0].finished
    assert len(steps) > 2
    merged_slow, merged_steps = merge_deltas(slow), merge_deltas(steps)
    assert merged_slow.keys() == set(range(n))
    for index in range(n):
        got, want = merged_slow[index], merged_steps[index]
        assert len(got["token_ids"]) == 10
        assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
        assert [lp.keys() for lp in got["logprobs"]] == [lp.keys() for lp in want["logprobs"]]
        assert got["finish_reason"] == want["finish_reason"] == "length"
    run(assert_all_blocks_back(engine))


def test_breaking_out_of_the_stream_aborts_and_frees_blocks(engine: AsyncLLM) -> None:
    iterations: list[IterationStats] = []

    def listener(iteration: IterationStats, _stats: SchedulerStats | None) -> None:
        iterations.append(iteration)

    engine.add_stats_listener(listener)

    async def main() -> list[RequestOutput]:
        received = []
        async for out in engine.generate("Break early", greedy(200, ignore_eos=True), "brk"):
            received.append(out)
            if len(received) == 3:
                break
        # The dropped generator is closed by a task the event loop schedules at once; its
        # abort then goes out before the next utility call.
        for _ in range(3):
            await asyncio.sleep(0)
        await assert_all_blocks_back(engine)
        # The id is free again.
        return await collect(engine, "Break early", greedy(3), "brk")

    try:
        again = run(main())
    finally:
        engine.stats.remove_listener(listener)
    assert again[-1].finished
    aborted = [f for it in iterations for f in it.finished_requests if f.finish_reason == "abort"]
    assert [f.request_id for f in aborted] == ["brk"]
    assert aborted[0].num_generation_tokens < 200


def test_cancelling_the_consumer_aborts_in_the_core_at_once(engine: AsyncLLM) -> None:
    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=200,
                                    ignore_eos=True)
            async for _ in engine.generate({"prompt_token_ids": list(range(5, 40))}, params,
                                           "cancel-me"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        stats = await engine.get_stats()
        assert stats.num_running + stats.num_waiting == 2  # both samples are in the core
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The abort left with the cancellation, before this utility call: no waiting needed.
        await assert_all_blocks_back(engine)

    run(main())


def test_abort_ends_the_stream_with_an_abort_output(engine: AsyncLLM) -> None:
    async def main() -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        first = asyncio.Event()

        async def consume() -> None:
            async for out in engine.generate("Abort me", greedy(200, ignore_eos=True, n=2),
                                             "ext", CUMULATIVE):
                outputs.append(out)
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        await engine.abort("ext")
        await task
        await assert_all_blocks_back(engine)
        await engine.abort(["ext", "never-existed"])  # unknown ids are ignored
        return outputs

    outputs = run(main())
    last = outputs[-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    assert all(not o.finished for o in outputs[:-1])
    assert last.outputs[0].token_ids[:len(outputs[0].outputs[0].token_ids)] == \
        outputs[0].outputs[0].token_ids


@pytest.mark.parametrize(("prompt", "params", "match"), [
    ("", greedy(4), "prompt"),
    ({"prompt_token_ids": []}, greedy(4), "prompt_token_ids"),
    ({"prompt_token_ids": [10**9]}, greedy(4), r"prompt_token_ids must be integers in \[0, "),
    ({"prompt_token_ids": [-1]}, greedy(4), "prompt_token_ids"),
    ({"prompt_token_ids": [5] * 300}, greedy(4), r"max_model_len \(256\)"),
    ({"text": "hi"}, greedy(4), "'prompt' or 'prompt_token_ids'"),
    (3.5, greedy(4), "prompt must be"),
])
def test_bad_input_raises_value_error_without_reaching_the_core(
        engine: AsyncLLM, prompt: Any, params: SamplingParams, match: str) -> None:
    async def main() -> tuple[SchedulerStats, SchedulerStats]:
        before = await engine.get_stats()
        with pytest.raises(ValueError, match=match):
            async for _ in engine.generate(prompt, params, "bad"):
                pass
        return before, await engine.get_stats()

    before, after = run(main())
    assert after == before  # not a single prompt token reached the scheduler
    assert engine.is_healthy()
    assert not engine.output_processor.requests and not engine._streams


def test_duplicate_request_id_and_unknown_utility_are_refused(engine: AsyncLLM) -> None:
    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("one", greedy(200, ignore_eos=True), "dup"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
            async for _ in engine.generate("two", greedy(4), "dup"):
                pass
        with pytest.raises(ValueError, match=r"unknown utility 'explode'; allowed: \['stats'"):
            await engine.call_utility("explode")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await assert_all_blocks_back(engine)

    run(main())


def test_bad_frames_are_dropped_and_both_loops_go_on(engine: AsyncLLM,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    def add(request_id: str, **changes: object) -> AddRequest:
        return AddRequest(request=EngineCoreRequest(
            request_id=request_id, prompt_token_ids=[5], sampling_params=greedy(4),
            max_tokens=4), **changes)

    wrong_version = add("v", version=WIRE_VERSION + 1)
    # Well-formed, but sampling parameters SamplingParams refuses: decoding fails on them.
    fields = msgspec.to_builtins(add("refused"))
    fields["request"]["sampling_params"]["stop"] = [""]
    refused = msgspec.msgpack.encode(fields)
    for frame in (b"\xc1 not msgpack", Encoder().encode(wrong_version), b"", refused):
        engine._input_socket.send(frame)
    # And garbage into the front end's output socket, from a stranger on the same address.
    context = zmq.Context()
    stranger = context.socket(zmq.PUSH)
    stranger.connect(engine.output_address)

    async def main() -> list[RequestOutput]:
        stranger.send(b"\x93\x01\x02\x03")
        stranger.send(Encoder().encode(wrong_version))
        outputs = await collect(engine, "still alive?", greedy(5, ignore_eos=True), "alive")
        # The stranger's frames come over its own connection, in no order with the engine
        # core's outputs (on a loaded machine after them): wait for both drops (bounded)
        # before the stranger closes, which would discard frames not yet sent.
        deadline = time.monotonic() + 20
        while len(dropped_frames()) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return outputs

    def dropped_frames() -> list[str]:
        return [r.getMessage() for r in caplog.records if "dropped a frame" in r.getMessage()]

    try:
        with caplog.at_level(logging.ERROR, logger="sluice"):
            outputs = run(main())
    finally:
        stranger.close(linger=0)
        context.term()
    assert outputs[-1].finished and len(merge_deltas(outputs)[0]["token_ids"]) == 5
    assert engine.is_healthy()
    run(assert_all_blocks_back(engine))
    dropped = dropped_frames()
    assert len(dropped) == 2
    assert "malformed response frame" in dropped[0] and "version" in dropped[1]


def test_killed_engine_core_fails_every_request_fast(make_engine: Callable[..., AsyncLLM]
                                                     ) -> None:
    llm = make_engine()

    async def main() -> None:
        first = asyncio.Event()

        async def consume(request_id: str) -> None:
            async for _ in llm.generate("Kill the core", greedy(200, ignore_eos=True),
                                        request_id):
                first.set()

        tasks = [asyncio.create_task(consume(f"k{i}")) for i in range(3)]
        await first.wait()
        os.kill(llm.engine_core_pid, signal.SIGKILL)
        start = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - start < 3.0
        assert [type(r) for r in results] == [EngineDeadError] * 3
        assert "exited with status -9" in str(results[0])
        assert not llm.is_healthy() and not llm.is_running
        assert llm.dead_error is not None and "status -9" in llm.dead_error
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="status -9"):
            async for _ in llm.generate("after", greedy(2), "after"):
                pass
        with pytest.raises(EngineDeadError):
            await llm.get_stats()
        assert time.monotonic() - start < 0.5

    run(main())
    llm.shutdown()
    llm.shutdown()


def test_an_error_in_the_core_loop_is_reported_and_the_core_exits(
        make_engine: Callable[..., AsyncLLM]) -> None:
    llm = make_engine()
    vocab_size = llm.hf_config.vocab_size

    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in llm.generate("victim", greedy(200, ignore_eos=True), "victim"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        # A request the front end would have refused: the model cannot embed this token.
        llm._send(AddRequest(request=EngineCoreRequest(
            request_id="poison", prompt_token_ids=[vocab_size + 7], sampling_params=greedy(4),
            max_tokens=4)))
        with pytest.raises(EngineDeadError, match="IndexError"):
            await task

    run(main())
    assert llm.dead_error.startswith("IndexError")
    llm._process.join(5.0)
    assert llm._process.exitcode == 1


def test_shutdown_fails_requests_in_flight_and_cleans_up(
        make_engine: Callable[..., AsyncLLM]) -> None:
    llm = make_engine()

    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in llm.generate("shut", greedy(200, ignore_eos=True), "s"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await task
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in llm.generate("after", greedy(2), "after"):
                pass

    run(main())
    assert not llm._process.is_alive() and not os.path.exists(llm._core.ipc_dir)
    assert not llm.is_healthy()
    llm.shutdown()


_ORPHAN_SCRIPT = """
import sys, time
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.async_llm import AsyncLLM
if __name__ == "__main__":
    llm = AsyncLLM.from_engine_args(EngineArgs(model=sys.argv[1], dtype="float32",
                                               block_size=8, max_model_len=256),
                                    ready_timeout_s=120.0, log_stats=False)
    print(llm.engine_core_pid, llm.input_address, flush=True)
    time.sleep(120)
"""


def process_exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # exited, not reaped
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def test_engine_core_exits_when_its_front_end_dies(qwen3_dir: str, tmp_path: Any) -> None:
    # A temp dir too long for a Unix socket path: the sockets fall back to loopback TCP.
    long_tmp = tmp_path / ("d" * 110)
    long_tmp.mkdir()
    front_end = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, qwen3_dir], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(long_tmp)})
    core_pid = None
    try:
        line = front_end.stdout.readline()
        core_pid, address = int(line.split()[0]), line.split()[1]
        assert address.startswith("tcp://127.0.0.1:")
        assert not process_exited(core_pid)
        front_end.kill()
        front_end.wait(10)
        deadline = time.monotonic() + 5.0
        while not process_exited(core_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_exited(core_pid), "the engine core outlived its front end"
    finally:
        front_end.kill()
        front_end.wait(10)
        if core_pid is not None and not process_exited(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def test_a_core_that_fails_to_start_raises_and_leaves_no_process(qwen3_dir: str) -> None:
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(EngineDeadError, match=r"failed to start: ValueError: max_model_len "
                                              r"\(256\) needs 32 KV blocks"):
        start_engine(qwen3_dir, num_gpu_blocks_override=4)
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_stats_logger_reports_throughput_only_while_busy(
        caplog: pytest.LogCaptureFixture) -> None:
    stats_logger = StatsLogger(interval_s=3600.0)
    busy = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25,
                          prefix_cache_queries=200, prefix_cache_hits=50, num_free_blocks=30,
                          num_blocks=40)
    now = time.monotonic()
    stats_logger._last_log_time = now - 2.0
    stats_logger(IterationStats(timestamp=0.0, num_prompt_tokens=100, num_generation_tokens=40),
                 busy)
    with caplog.at_level(logging.INFO, logger="sluice"):
        line = stats_logger.log(now)
        assert stats_logger.log(now + 2.0) is not None  # still running: report again
        stats_logger(IterationStats(timestamp=0.0), SchedulerStats(num_blocks=40,
                                                                   num_free_blocks=40))
        assert stats_logger.log(now + 4.0) is None  # idle and nothing happened
    assert line == ("Engine: prompt throughput 50.0 tok/s, generation throughput 20.0 tok/s, "
                    "running 2 reqs, waiting 1 reqs, KV cache usage 25.0%, "
                    "prefix cache hit rate 25.0%")
    assert [r.getMessage() for r in caplog.records][0] == line


def test_two_front_ends_attached_to_one_core_each_get_their_own_outputs(
        qwen3_dir: str, reference: LLM) -> None:
    """Several API servers' AsyncLLMs over one engine core (core_client.launch_shared_engine_core):
    concurrent requests from both, stop strings (FinishRequests) and an abort from one, and
    utility calls from each reach the right front end; both see the other's freed blocks."""
    from sluice.engine.async_llm import core_process_args
    from sluice.engine.core_client import launch_shared_engine_core

    args = EngineArgs(model=qwen3_dir, **ENGINE_KWARGS)
    core = launch_shared_engine_core(core_process_args(args, args.create_engine_config()), 2,
                                     logging.WARNING)
    front_ends: list[AsyncLLM] = []
    try:
        for attachment in core.attachments:
            front_ends.append(AsyncLLM(args, ready_timeout_s=120.0, log_stats=False,
                                       attach=attachment))
        prompts = ["Hello world", {"prompt_token_ids": list(range(20, 45))},
                   "The quick brown fox", {"prompt_token_ids": list(range(60, 90))}]
        params = greedy(12, ignore_eos=True)
        expected = reference.generate(prompts, params, use_tqdm=False)

        async def main() -> list[list[RequestOutput]]:
            victim = asyncio.create_task(collect(front_ends[1], "Abort me", greedy(
                200, ignore_eos=True), "victim"))
            streams = await asyncio.gather(*(
                collect(front_ends[i % 2], prompt, params, f"req-{i}", FINAL_ONLY)
                for i, prompt in enumerate(prompts)))
            await front_ends[1].abort("victim")
            assert (await victim)[-1].outputs[0].finish_reason == "abort"
            # The core reads each front end's messages in order, but the two front ends'
            # against each other in any order: front end 1 asks first, after its own abort.
            for front_end in reversed(front_ends):
                await assert_all_blocks_back(front_end)
            return streams

        streams = run(main())
        for stream, want in zip(streams, expected):
            assert stream[-1].outputs[0].token_ids == want.outputs[0].token_ids
        assert front_ends[0].engine_core_pid == front_ends[1].engine_core_pid == core.process.pid
    finally:
        for front_end in front_ends:
            front_end.shutdown()
        assert core.process.is_alive()  # the front ends do not stop a core they attached to
        core.release()
    assert not core.process.is_alive()


def test_the_api_server_starts_the_core_before_it_imports_pytorch(qwen3_dir: str) -> None:
    # The API server's modules import no PyTorch: it starts the engine core (which imports
    # PyTorch itself) and then loads the tokenizer (transformers imports PyTorch) while the core
    # starts, so the two start-ups overlap instead of running one after the other.
    code = ("import sys\n"
            "import sluice.entrypoints.openai.api_server\n"
            "import sluice.entrypoints.openai.multi_server\n"
            "from sluice.engine.arg_utils import EngineArgs\n"
            "from sluice.engine.async_llm import core_process_args\n"
            "from sluice.engine.core_client import launch_engine_core\n"
            f"args = EngineArgs(model={qwen3_dir!r}, device='cpu', dtype='float32')\n"
            "core = launch_engine_core(core_process_args(args, args.create_engine_config()), 30)\n"
            "heavy = sorted({'torch', 'transformers', 'triton'} & set(sys.modules))\n"
            "started = core.process.is_alive()\n"
            "core.release()\n"
            "print('core started:', started, 'heavy:', heavy)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "core started: True heavy: []" in run.stdout, run.stdout[-500:]
