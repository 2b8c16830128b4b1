"""The scheduler's side of the KV connector contract, without a model: a scripted connector
answers lookups, the runner's part is played by hand (one token for each request that reached
the end of its known tokens, plus the connector report the test wants)."""

from __future__ import annotations

import time

import pytest

from sluice.config import KVTransferConfig, SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_connector import KVCacheSpec, KVConnectorScheduler
from sluice.core.outputs import (
    FirstToken,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from sluice.core.request import Request, RequestStatus
from sluice.core.scheduler import Scheduler
from sluice.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 32
SPEC = KVCacheSpec(model="m", dtype="float32", block_size=BLOCK, num_kv_heads=1, head_dim=4,
                   layer_names=("l0",))


class ScriptedConnector(KVConnectorScheduler):
    """Answers get_num_new_matched_tokens from a per-request script (one entry per call, the
    last one repeats), and records what the scheduler told it."""

    def __init__(self, config: KVTransferConfig) -> None:
        super().__init__(config, SPEC)
        self.script: dict[str, list[tuple[int | None, bool]]] = {}
        self.allocs: dict[str, tuple[list[int], int]] = {}
        self.finished: list[str] = []
        self.delay_free: set[str] = set()
        self.reports: list[KVConnectorOutput] = []

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        answers = self.script.get(request.request_id, [(0, False)])
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.allocs[request.request_id] = (list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput, scheduler: object) -> None:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.reports.append(output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict]:
        self.finished.append(request.request_id)
        return request.request_id in self.delay_free, {"sent_from": block_ids}


def make(policy: str = "recompute", abort_timeout_s: float = 60.0,
         **kw: object) -> tuple[Scheduler, ScriptedConnector]:
    config = KVTransferConfig(kv_connector="Scripted", kv_load_failure_policy=policy,
                              kv_load_abort_timeout_s=abort_timeout_s)
    connector = ScriptedConnector(config)
    scheduler_config = SchedulerConfig(**{"max_model_len": 64, "max_num_batched_tokens": 32,
                                          "max_num_seqs": 8, **kw})
    scheduler = Scheduler(scheduler_config, KVCacheManager(NUM_BLOCKS, BLOCK), connector, config)
    return scheduler, connector


def request(req_id: str, num_tokens: int, start: int = 0, max_tokens: int = 3) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, list(range(start, start + num_tokens)), params, max_tokens=max_tokens)


def run(scheduler: Scheduler, output: SchedulerOutput, report: KVConnectorOutput | None = None,
        no_sample: set[str] = frozenset()) -> list:
    """The runner's part: a token for every request whose chunk reached its end."""
    req_ids, sampled = [], []
    for req_id in output.num_scheduled_tokens:
        req = scheduler.requests[req_id]
        req_ids.append(req_id)
        done = req.num_computed_tokens == req.num_tokens and req_id not in no_sample
        sampled.append([7] if done else [])
    runner_output = ModelRunnerOutput(req_ids, sampled,
                                      kv_connector_output=report or KVConnectorOutput())
    return scheduler.update_from_output(output, runner_output)


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.get_num_free_blocks()


def all_blocks_back(scheduler: Scheduler) -> bool:
    scheduler.kv_cache_manager.check_integrity()
    return free_blocks(scheduler) == NUM_BLOCKS - 1


def test_a_request_the_connector_cannot_answer_yet_does_not_block_the_queue() -> None:
    scheduler, connector = make()
    connector.script["a"] = [(None, False)] * 3 + [(0, False)]
    scheduler.add_request(request("a", 6))
    scheduler.add_request(request("b", 6, start=100))
    scheduled = []
    for _ in range(4):
        out = scheduler.schedule()
        scheduled.append(sorted(out.num_scheduled_tokens))
        run(scheduler, out)
    # "b" went ahead while "a" was passed over; "a" kept its place and went on step 4.
    assert scheduled[:3] == [["b"], ["b"], ["b"]]
    assert "a" in scheduled[3]
    assert [r.request_id for r in scheduler.waiting] == []


def test_async_load_parks_the_request_until_the_load_is_reported_done() -> None:
    scheduler, connector = make()
    connector.script["a"] = [(8, True)]
    scheduler.add_request(request("a", 13))
    scheduler.add_request(request("b", 5, start=100))
    out = scheduler.schedule()
    a = scheduler.requests["a"]
    assert sorted(out.num_scheduled_tokens) == ["b"]  # "a" costs no budget while it loads
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    block_ids, num_external = connector.allocs["a"]
    assert num_external == 8 and len(block_ids) == 2
    run(scheduler, out)
    out = scheduler.schedule()  # not reported yet: still parked
    assert "a" not in out.num_scheduled_tokens
    run(scheduler, out, KVConnectorOutput(finished_recving={"a"}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["a"] == 13 - 8
    new = next(r for r in out.scheduled_new_reqs if r.req_id == "a")
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == block_ids
    # The loaded blocks entered the prefix cache once the load was known good.
    assert scheduler.kv_cache_manager.num_cached_blocks["a"] >= 2
    assert a.num_cached_tokens == 8


def test_an_async_load_of_the_whole_prompt_without_a_first_token_recomputes_its_last() -> None:
    scheduler, connector = make()
    connector.script["a"] = [(12, True)]  # the whole prompt
    scheduler.add_request(request("a", 12))
    run(scheduler, scheduler.schedule())
    assert connector.allocs["a"][1] == 12
    out = scheduler.schedule()
    run(scheduler, out, KVConnectorOutput(finished_recving={"a"}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["a"] == 1  # the last token's logits are computed here
    new = next(r for r in out.scheduled_new_reqs if r.req_id == "a")
    assert new.num_computed_tokens == 11 and new.output_token_ids == []


def test_an_async_load_that_brings_the_first_token_continues_from_it() -> None:
    scheduler, connector = make()
    connector.script["a"] = [(12, True)]
    scheduler.add_request(request("a", 12, max_tokens=3))
    run(scheduler, scheduler.schedule())
    first = FirstToken(token_id=99, logprobs={99: (-0.25, 1)})
    outputs = run(scheduler, scheduler.schedule(),
                  KVConnectorOutput(finished_recving={"a"}, first_tokens={"a": first}))
    [output] = outputs
    assert output.new_token_ids == [99] and output.finish_reason is None
    assert output.new_logprobs is None  # the request did not ask for logprobs
    out = scheduler.schedule()
    # The prompt is computed; the step computes the first token's KV and samples the second.
    assert out.num_scheduled_tokens["a"] == 1
    new = next(r for r in out.scheduled_new_reqs if r.req_id == "a")
    assert new.num_computed_tokens == 12 and new.output_token_ids == [99]
    outputs = run(scheduler, out)
    assert [o.new_token_ids for o in outputs] == [[7]]
    assert scheduler.requests["a"].output_token_ids == [99, 7]


def test_a_first_token_that_ends_the_request_frees_it_with_no_step() -> None:
    scheduler, connector = make()
    connector.script["a"] = [(12, True)]
    scheduler.add_request(request("a", 12, max_tokens=1))
    run(scheduler, scheduler.schedule())
    outputs = run(scheduler, scheduler.schedule(), KVConnectorOutput(
        finished_recving={"a"}, first_tokens={"a": FirstToken(token_id=5)}))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([5], "length")]
    assert connector.finished == ["a"] and all_blocks_back(scheduler)
    assert scheduler.schedule().num_scheduled_tokens == {}


def test_a_synchronous_load_stops_at_the_last_full_block_before_the_last_token() -> None:
    scheduler, connector = make()
    connector.script["a"] = [(12, False)]
    scheduler.add_request(request("a", 12))
    out = scheduler.schedule()
    # 11 tokens would share block 2 with the token computed in the same step.
    assert connector.allocs["a"][1] == 8
    assert out.num_scheduled_tokens["a"] == 4


def test_failed_synchronous_load_truncates_at_the_first_bad_block_and_recomputes() -> None:
    scheduler, connector = make()
    connector.script["a"] = [(8, False)]
    scheduler.add_request(request("a", 13))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["a"] == 5  # 8 loaded in the step, 5 computed
    block_ids = scheduler.get_block_ids("a")
    # The second loaded block failed: the runner did not sample "a".
    outputs = run(scheduler, out, KVConnectorOutput(invalid_block_ids={block_ids[1]}),
                  no_sample={"a"})
    a = scheduler.requests["a"]
    assert outputs == [] and a.num_output_tokens == 0
    assert a.num_computed_tokens == 4 and a.num_output_placeholders == 0
    # Only the good block was cached; the bad one is recomputed, and not shared meanwhile.
    assert scheduler.kv_cache_manager.num_cached_blocks["a"] == 1
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["a"] == 13 - 4
    run(scheduler, out)
    assert a.num_output_tokens == 1
    assert a.num_cached_tokens == 4


def test_failed_load_with_policy_fail_ends_the_request_with_a_clear_error() -> None:
    scheduler, connector = make(policy="fail")
    connector.script["a"] = [(8, True)]
    scheduler.add_request(request("a", 13))
    run(scheduler, scheduler.schedule())
    block_ids = scheduler.get_block_ids("a")
    outputs = run(scheduler, scheduler.schedule(),
                  KVConnectorOutput(invalid_block_ids={block_ids[0]},
                                    finished_recving={"a"}))
    assert len(outputs) == 1 and outputs[0].finish_reason == "error"
    assert f"KV load failed for blocks [{block_ids[0]}]" in outputs[0].stop_reason
    assert "a" not in scheduler.requests and connector.finished == ["a"]
    assert all_blocks_back(scheduler)


def test_abort_during_an_async_load_keeps_the_blocks_until_the_load_ends() -> None:
    scheduler, connector = make()
    connector.script["a"] = [(8, True)]
    scheduler.add_request(request("a", 13))
    run(scheduler, scheduler.schedule())
    held = free_blocks(scheduler)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert connector.finished == ["a"]
    # The load may still write the blocks: nobody else may get them.
    assert free_blocks(scheduler) == held and scheduler.has_pending_kv_transfers()
    run(scheduler, scheduler.schedule())
    assert free_blocks(scheduler) == held
    run(scheduler, scheduler.schedule(), KVConnectorOutput(finished_recving={"a"}))
    assert all_blocks_back(scheduler) and not scheduler.has_pending_kv_transfers()


def test_abort_during_an_async_load_frees_the_blocks_after_the_deadline() -> None:
    scheduler, connector = make(abort_timeout_s=0.05)
    connector.script["a"] = [(8, True)]
    scheduler.add_request(request("a", 13))
    run(scheduler, scheduler.schedule())
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not all_blocks_back(scheduler)
    time.sleep(0.06)
    run(scheduler, scheduler.schedule())  # a load that never reports must not leak
    assert all_blocks_back(scheduler)


def test_delayed_free_keeps_the_blocks_until_the_send_is_reported_done() -> None:
    scheduler, connector = make()
    connector.delay_free.add("a")
    scheduler.add_request(request("a", 9, max_tokens=1))
    out = scheduler.schedule()
    block_ids = scheduler.get_block_ids("a")
    outputs = run(scheduler, out)
    assert outputs[0].finish_reason == "length"
    assert outputs[0].kv_transfer_params == {"sent_from": block_ids}
    # An abort now (the client went away) changes nothing: the send still reads the blocks.
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not all_blocks_back(scheduler) and scheduler.has_pending_kv_transfers()
    # No other request gets those blocks meanwhile.
    scheduler.add_request(request("b", 9, start=100))
    run(scheduler, scheduler.schedule())
    assert not set(scheduler.get_block_ids("b")) & set(block_ids)
    run(scheduler, scheduler.schedule(), KVConnectorOutput(finished_sending={"a"}))
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert all_blocks_back(scheduler)


def test_kv_transfer_config_names_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['kv_conector'\]"):
        KVTransferConfig.from_dict({"kv_conector": "OffloadingConnector"})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig.from_dict({"kv_connector": "X", "kv_role": "both"})
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        KVTransferConfig.from_dict({"kv_connector": "X", "kv_load_failure_policy": "retry"})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.from_dict("{kv_connector")
    config = KVTransferConfig.from_dict('{"kv_connector": "X", "kv_role": "kv_consumer"}')
    assert config.is_consumer and not config.is_producer


def test_a_loaded_request_goes_before_one_preempted_that_needs_its_blocks() -> None:
    """11 blocks: "a"'s asynchronous load holds 5 and ends while "r" decodes; "r" then runs out
    of blocks and preempts itself to the head of the queue, where it needs blocks "a" holds.
    "a" goes first (behind "r", neither could ever run), then "r"; every block comes back."""
    config = KVTransferConfig(kv_connector="Scripted")
    connector = ScriptedConnector(config)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=32,
                                          max_num_seqs=8),
                          KVCacheManager(12, BLOCK), connector, config)
    connector.script["a"] = [(20, True)]
    scheduler.add_request(request("r", 20, start=100, max_tokens=20))
    run(scheduler, scheduler.schedule())
    scheduler.add_request(request("a", 24))
    out = scheduler.schedule()
    assert scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    run(scheduler, out, KVConnectorOutput(finished_recving={"a"}))
    finished, preempted = [], False
    for _ in range(60):
        if not scheduler.requests:
            break
        out = scheduler.schedule()
        preempted |= "r" in out.preempted_req_ids
        finished += [o.req_id for o in run(scheduler, out) if o.finish_reason]
    assert preempted and finished == ["a", "r"]
    assert free_blocks(scheduler) == 11
    scheduler.kv_cache_manager.check_integrity()
