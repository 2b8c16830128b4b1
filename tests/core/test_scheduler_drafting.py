"""The scheduler's side of speculative decoding without a model: n-gram drafts are proposed only
from a known last token (never while one is in flight), a step with drafts must run
synchronously, and the drafting policy's decisions are counted per step."""

from __future__ import annotations

from sluice.config import SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.outputs import ModelRunnerOutput, SchedulerOutput
from sluice.core.request import Request
from sluice.core.scheduler import Scheduler
from sluice.sampling_params import SamplingParams
from sluice.spec_decode.config import SpeculativeConfig


def make_scheduler(**policy: object) -> Scheduler:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=3, **policy)
    config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8,
                             speculative_config=spec)
    return Scheduler(config, KVCacheManager(64, 4, enable_caching=True))


def add(scheduler: Scheduler, req_id: str, prompt: list[int], **params: object) -> None:
    sampling = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **params)
    scheduler.add_request(Request(req_id, prompt, sampling, max_tokens=16))


def finish_step(scheduler: Scheduler, output: SchedulerOutput, tokens: dict[str, list[int]],
                ) -> None:
    """The runner's answer: `tokens` for each request that samples in the step."""
    req_ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids, [tokens.get(r, []) for r in req_ids]))


ALWAYS = {"disable_by_batch_size": None, "min_accepted_tokens_per_step": 0}
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]  # continues with 7, 5, 6 by prompt lookup


def test_drafts_come_only_after_the_token_in_flight_is_back() -> None:
    scheduler = make_scheduler(**ALWAYS)
    add(scheduler, "a", PROMPT)
    prefill = scheduler.schedule()
    assert not prefill.scheduled_spec_decode_tokens
    assert not scheduler.runs_synchronously(prefill)
    # Async scheduling: the prefill's token is still in flight. Drafting is on, so the engine
    # would take it first; scheduled anyway, the step decodes the token in flight, no drafts.
    assert scheduler.drafts_need_tokens_in_flight()
    overlapped = scheduler.schedule()
    assert overlapped.num_scheduled_tokens == {"a": 1}
    assert not overlapped.scheduled_spec_decode_tokens
    finish_step(scheduler, prefill, {"a": [7]})
    finish_step(scheduler, overlapped, {"a": [5]})
    assert not scheduler.drafts_need_tokens_in_flight()
    # Tokens known: 5 6 7 5 6 7 5 6 7 5 -> drafts 6 7 5 with the last token, synchronously.
    drafted = scheduler.schedule()
    assert drafted.scheduled_spec_decode_tokens == {"a": [6, 7, 5]}
    assert drafted.num_scheduled_tokens == {"a": 4}
    assert scheduler.runs_synchronously(drafted)
    # Two drafts accepted, the third rejected (the target's own token instead), so the
    # rejected draft's position rolls back.
    finish_step(scheduler, drafted, {"a": [6, 7, 9]})
    request = scheduler.requests["a"]
    assert request.output_token_ids == [7, 5, 6, 7, 9]
    assert request.num_computed_tokens == request.num_tokens - 1
    stats = scheduler.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert scheduler.drafts.policy.expected_accepted_tokens() == 2.0


def test_off_for_the_batch_size_no_drafts_and_the_steps_overlap() -> None:
    scheduler = make_scheduler(disable_by_batch_size=2, min_accepted_tokens_per_step=0)
    add(scheduler, "a", PROMPT)
    add(scheduler, "b", [9, 8, 9, 8, 9, 8])
    finish_step(scheduler, scheduler.schedule(), {"a": [7], "b": [9]})
    for _ in range(3):
        assert not scheduler.drafts_need_tokens_in_flight()
        output = scheduler.schedule()
        assert not output.scheduled_spec_decode_tokens
        assert not scheduler.runs_synchronously(output)
        finish_step(scheduler, output, {"a": [7], "b": [9]})
    stats = scheduler.spec_decoding_stats
    # The first step had no running request (not counted), then three at batch 2.
    assert (stats.num_steps_drafting, stats.num_steps_off_batch_size,
            stats.num_steps_off_acceptance) == (0, 3, 0)


def test_requests_that_cannot_speculate_get_no_drafts_and_no_probes() -> None:
    scheduler = make_scheduler(**ALWAYS)
    add(scheduler, "penalised", PROMPT, repetition_penalty=1.2)
    finish_step(scheduler, scheduler.schedule(), {"penalised": [7]})
    output = scheduler.schedule()
    assert not output.scheduled_spec_decode_tokens
    assert not scheduler.drafts.policy.tracks("penalised")
    finish_step(scheduler, output, {"penalised": [5]})
    assert scheduler.spec_decoding_stats.num_steps_drafting == 0  # no request could draft


def test_low_acceptance_turns_drafting_off_and_a_host_probe_turns_it_on() -> None:
    scheduler = make_scheduler(disable_by_batch_size=None, min_accepted_tokens_per_step=1.0,
                               probe_interval=1)
    add(scheduler, "a", [1, 2, 3, 4, 5, 6])  # nothing recurs: the first probe finds nothing
    finish_step(scheduler, scheduler.schedule(), {"a": [7]})
    assert scheduler.drafts.policy.expected_accepted_tokens() == 0.0
    # The output starts repeating 7 8: probes see it, drafting comes back on.
    for token in (8, 7, 8, 7, 8, 7, 8):
        output = scheduler.schedule()
        assert not output.scheduled_spec_decode_tokens
        finish_step(scheduler, output, {"a": [token]})
        if scheduler.drafts.policy.wants_drafts(1):
            break
    assert scheduler.drafts.policy.wants_drafts(1)
    last = scheduler.requests["a"].output_token_ids[-1]
    drafted = scheduler.schedule()
    following = 8 if last == 7 else 7
    assert drafted.scheduled_spec_decode_tokens["a"][:2] == [following, last]
    stats = scheduler.spec_decoding_stats
    assert stats.num_steps_off_acceptance > 0 and stats.num_steps_drafting == 1
    assert stats.num_draft_tokens == 0  # probes are never counted as drafts
