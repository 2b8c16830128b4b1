"""The executor boundary: the same greedy tokens from the model in the engine's process and in
worker processes (one, or two replica ranks fed the same step messages), and a worker that dies
ends the engine with a clear error within 5 s (behind the server: tests/server)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from sluice import LLM, SamplingParams
from sluice.core.request import EngineCoreRequest
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.core import EngineCore
from sluice.errors import EngineDeadError
from sluice.executor.multiproc import MultiprocExecutor

pytestmark = pytest.mark.serial

ENGINE = dict(dtype="float32", max_model_len=256, block_size=8, seed=0,
              max_num_batched_tokens=48)  # prompts of up to 90 tokens prefill in chunks
PROMPTS = [list(range(10, 100)), list(range(200, 231)), list(range(90, 100)) * 5,
           list(range(10, 60))]  # the last shares a prefix with the first


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(),
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(qwen3_dir: str) -> list[list[int]]:
    return generate(LLM(model=qwen3_dir, **ENGINE))


@pytest.fixture
def mp_llm(qwen3_dir: str) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(**kw: object) -> LLM:
        made.append(LLM(model=qwen3_dir, distributed_executor_backend="mp", **{**ENGINE, **kw}))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()


def worker_pids(llm: LLM) -> list[int]:
    return llm.llm_engine.engine_core.executor.worker_pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped yet) is not running either.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_one_worker_process_gives_the_same_greedy_tokens(
        mp_llm: Callable[..., LLM], expected: list[list[int]], async_scheduling: bool) -> None:
    llm = mp_llm(async_scheduling=async_scheduling)
    assert len(worker_pids(llm)) == 1 and worker_pids(llm)[0] != os.getpid()
    assert generate(llm) == expected
    assert generate(llm) == expected  # again, over the prefix cache
    llm.llm_engine.kv_cache_manager.check_integrity()


def test_cpu_tier_in_a_worker_process_gives_the_same_greedy_tokens(
        mp_llm: Callable[..., LLM], expected: list[list[int]]) -> None:
    llm = mp_llm(kv_offloading_size=0.01, num_gpu_blocks_override=40)
    for _ in range(3):
        assert generate(llm) == expected
    assert llm.llm_engine.scheduler.connector.get_stats()["saved_blocks"] > 0
    manager = llm.llm_engine.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1


def test_two_ranks_receive_the_same_steps_and_rank_0_speaks(
        qwen3_dir: str, expected: list[list[int]]) -> None:
    config = EngineArgs(model=qwen3_dir, **ENGINE).create_engine_config()
    executor = MultiprocExecutor(config, world_size=2)
    core = EngineCore(config, executor=executor)
    try:
        pids = executor.worker_pids
        assert len(set(pids)) == 2 and all(alive(pid) for pid in pids)
        for i, prompt in enumerate(PROMPTS):
            core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt,
                                               sampling_params=greedy(), max_tokens=10))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while core.has_unfinished_requests():
            for out in core.step():
                tokens[out.req_id] += out.new_token_ids
        assert [tokens[str(i)] for i in range(len(PROMPTS))] == expected
    finally:
        core.shutdown()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "workers outlived shutdown"
        time.sleep(0.05)


def test_a_killed_worker_ends_the_engine_with_a_clear_error_within_5_s(
        mp_llm: Callable[..., LLM]) -> None:
    llm = mp_llm()
    engine = llm.llm_engine
    engine.add_request("victim", {"prompt_token_ids": PROMPTS[0]}, greedy(200))
    engine.step()
    pid = worker_pids(llm)[0]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(EngineDeadError, match=rf"worker rank 0 \(pid {pid}\) exited with status "
                                              r"-9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - killed_at < 5.0
    with pytest.raises(EngineDeadError, match="worker rank 0"):  # and every call after
        engine.step()
