"""Scheduler policy, without a model: the runner's part is played by appending one token per
request that reached the end of its known tokens (what the real runner samples)."""

from __future__ import annotations

import pytest

from sluice.config import SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.outputs import ModelRunnerOutput, SchedulerOutput
from sluice.core.request import Request, RequestStatus
from sluice.core.scheduler import Scheduler
from sluice.sampling_params import SamplingParams

BLOCK = 4


def make_scheduler(num_blocks: int = 64, **kw: object) -> Scheduler:
    config = SchedulerConfig(**{"max_model_len": 64, "max_num_batched_tokens": 16,
                                "max_num_seqs": 8, **kw})
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, enable_caching=True))


def make_request(req_id: str, num_tokens: int, max_tokens: int = 4, start: int = 0) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, list(range(start, start + num_tokens)), params,
                   max_tokens=max_tokens)


def fake_run(scheduler: Scheduler, output: SchedulerOutput, token: int = 1) -> None:
    req_ids, sampled = [], []
    for req_id in output.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        req_ids.append(req_id)
        done = request.num_computed_tokens == request.num_tokens
        sampled.append([token] if done else [])
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids, sampled))


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 40))
    chunks = []
    for _ in range(3):
        out = scheduler.schedule()
        chunks.append(out.num_scheduled_tokens["a"])
        fake_run(scheduler, out)
    assert chunks == [16, 16, 8]
    assert scheduler.requests["a"].num_output_tokens == 1


def test_running_requests_are_served_before_waiting_ones() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    fake_run(scheduler, scheduler.schedule())
    scheduler.add_request(make_request("b", 30, start=100))
    out = scheduler.schedule()
    # "a" decodes one token first, "b" gets the rest of the budget.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a"]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]


def test_max_num_seqs_caps_the_batch() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 5, start=10 * i))
    out = scheduler.schedule()
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_chunked_prefill_disabled_waits_for_a_whole_prompt() -> None:
    scheduler = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=20)
    scheduler.add_request(make_request("a", 12))
    scheduler.add_request(make_request("b", 12, start=50))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 12}  # "b" does not fit whole: it waits


def test_out_of_blocks_preempts_the_most_recently_admitted_request() -> None:
    # 7 usable blocks of 4 tokens.
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=64, max_model_len=28)
    for i, n in enumerate((8, 8, 8)):
        scheduler.add_request(make_request(f"r{i}", n, max_tokens=12, start=20 * i))
    fake_run(scheduler, scheduler.schedule())  # 6 blocks in use
    # Each decode step needs a fifth token slot per request: 3 new blocks, one is free.
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"r2"}
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]
    victim = scheduler.waiting[0]
    assert victim.request_id == "r2" and victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    fake_run(scheduler, out)
    scheduler.kv_cache_manager.check_integrity()


def test_resumed_request_is_sent_with_a_fresh_block_table() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=64, max_model_len=28)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 8, max_tokens=12, start=20 * i))
    fake_run(scheduler, scheduler.schedule())
    fake_run(scheduler, scheduler.schedule())  # preempts r2
    scheduler.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    resumed = [r for r in out.scheduled_cached_reqs if r.resumed_from_preemption]
    assert [r.req_id for r in resumed] == ["r2"]
    assert resumed[0].new_block_ids == scheduler.kv_cache_manager.get_block_ids("r2")
    assert "r0" in out.finished_req_ids
    # Preempting r2 freed its two blocks tail first; r1 took the leaf for its decode, so the
    # root block still hits and only the rest is recomputed.
    assert resumed[0].num_computed_tokens == 4
    assert out.num_scheduled_tokens["r2"] == 9 - 4


def test_max_tokens_and_abort_free_every_block() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6, max_tokens=3))
    scheduler.add_request(make_request("b", 6, max_tokens=50, start=40))
    for _ in range(3):
        fake_run(scheduler, scheduler.schedule())
    assert "a" not in scheduler.requests  # finished by length
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    manager = scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1
    assert not scheduler.has_unfinished_requests()


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="'a'"):
        scheduler.add_request(make_request("a", 3))
