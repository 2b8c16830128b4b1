"""The drafting policy alone (host logic, no engine): drafting is off from disable_by_batch_size
requests, off while the expected accepted tokens per request and step are below the threshold,
and host probes (n-gram) or probing steps (model proposers) turn it back on when drafts would be
accepted again."""

from __future__ import annotations

import pytest

from sluice.sampling_params import SamplingParams
from sluice.spec_decode.config import SpeculativeConfig
from sluice.spec_decode.policy import Drafting, DraftingPolicy, can_speculate


def policy(method: str = "ngram", **fields: object) -> DraftingPolicy:
    model = None if method == "ngram" else "/models/draft"
    return DraftingPolicy(SpeculativeConfig(method=method, num_speculative_tokens=4, model=model,
                                            **fields))


def test_batch_size_at_or_above_the_limit_turns_drafting_off() -> None:
    p = policy(disable_by_batch_size=4, min_accepted_tokens_per_step=0)
    p.add_request("a")
    assert [p.decide(b) for b in (1, 3, 4, 100)] == [
        Drafting.ON, Drafting.ON, Drafting.OFF_BATCH_SIZE, Drafting.OFF_BATCH_SIZE]
    assert p.decide(0) is Drafting.IDLE
    unlimited = policy(disable_by_batch_size=None, min_accepted_tokens_per_step=0)
    unlimited.add_request("a")
    assert unlimited.decide(10_000) is Drafting.ON


def test_no_request_that_can_speculate_is_idle() -> None:
    p = policy(min_accepted_tokens_per_step=0)
    assert p.decide(1) is Drafting.IDLE
    p.add_request("a")
    p.remove_request("a")
    assert p.decide(1) is Drafting.IDLE


def test_acceptance_below_the_threshold_turns_drafting_off_and_above_on() -> None:
    p = policy(min_accepted_tokens_per_step=1.5, disable_by_batch_size=None)
    p.add_request("a")
    assert p.expected_accepted_tokens() is None
    assert p.decide(1) is Drafting.OFF_ACCEPTANCE  # n-gram: measured by host probes first
    p.observe("a", 4)
    assert p.expected_accepted_tokens() == 4.0  # the first observation is the average
    assert p.decide(1) is Drafting.ON
    for _ in range(6):  # drafts rejected from now on: the average decays below 1.5
        p.observe("a", 0)
    assert p.expected_accepted_tokens() == pytest.approx(4 * 0.75 ** 6)
    assert p.decide(1) is Drafting.OFF_ACCEPTANCE


def test_drafting_once_on_stays_on_down_to_half_the_threshold() -> None:
    """Hysteresis: a switch costs overlap, so drafting does not flip around one threshold."""
    p = policy(min_accepted_tokens_per_step=1.5, disable_by_batch_size=None)
    p.add_request("a")
    p.observe("a", 2)
    assert p.begin_step(1) is Drafting.ON
    p.observe("a", 0)  # 1.5
    p.observe("a", 0)  # 1.125: below the threshold, above half of it
    assert p.begin_step(1) is Drafting.ON
    p.observe("a", 0)  # 0.84
    assert p.begin_step(1) is Drafting.ON
    p.observe("a", 0)  # 0.63: below half
    assert p.begin_step(1) is Drafting.OFF_ACCEPTANCE
    p.observe("a", 2, 0.5)  # 1.32: back above half, not above the threshold
    assert p.begin_step(1) is Drafting.OFF_ACCEPTANCE
    p.observe("a", 2, 0.5)  # 1.66
    assert p.begin_step(1) is Drafting.ON
    # The batch size turns it off at once, and the way back is the full threshold again.
    p.observe("a", 0)  # 1.24
    assert p.begin_step(2) is Drafting.ON  # no batch limit here
    limited = policy(min_accepted_tokens_per_step=1.5, disable_by_batch_size=2)
    limited.add_request("a")
    limited.observe("a", 2)
    assert limited.begin_step(1) is Drafting.ON
    assert limited.begin_step(2) is Drafting.OFF_BATCH_SIZE
    limited.observe("a", 0)  # 1.5
    limited.observe("a", 0)  # 1.125
    assert limited.begin_step(1) is Drafting.OFF_ACCEPTANCE


def test_expected_tokens_average_over_requests_and_new_ones_start_from_the_global_prior() -> None:
    p = policy(min_accepted_tokens_per_step=1.0, disable_by_batch_size=None)
    p.add_request("a")
    p.add_request("b")
    p.observe("a", 3)
    # b has no observation: it counts as the average over all requests so far (3).
    assert p.expected_accepted_tokens() == pytest.approx(3.0)
    p.observe("b", 0)  # b starts from the prior and moves a quarter of the way to 0
    assert p.expected_accepted_tokens() == pytest.approx((3.0 + 3.0 * 0.75) / 2)
    p.remove_request("a")
    assert p.expected_accepted_tokens() == pytest.approx(2.25)
    p.observe("gone", 4)  # a request the policy does not track changes nothing
    assert p.expected_accepted_tokens() == pytest.approx(2.25)


def test_host_probe_counts_the_leading_drafts_the_next_tokens_equal() -> None:
    p = policy(min_accepted_tokens_per_step=2.0, disable_by_batch_size=None, probe_interval=3)
    p.add_request("a")
    assert p.probes_wanted(1)
    assert p.wants_probe("a")
    p.start_probe("a", [7, 8, 9, 10])
    assert not p.wants_probe("a")  # one probe at a time
    p.observe_tokens("a", [7])
    p.observe_tokens("a", [8])
    assert p.expected_accepted_tokens() is None  # not settled while the tokens match
    p.observe_tokens("a", [1])  # the third draft would have been rejected: 2 accepted
    assert p.expected_accepted_tokens() == 2.0
    assert not p.probes_wanted(1)  # on: the verified drafts measure


def test_host_probe_settles_on_a_full_match_and_an_empty_draft_counts_zero() -> None:
    p = policy(min_accepted_tokens_per_step=3.0, disable_by_batch_size=None, probe_interval=1)
    p.add_request("a")
    p.start_probe("a", [])  # the proposer found nothing: this step would have gained nothing
    assert p.expected_accepted_tokens() == 0.0
    assert not p.wants_probe("a")  # probe_interval = 1: one step to wait
    assert p.wants_probe("a")
    p.start_probe("a", [5, 6])
    p.observe_tokens("a", [5, 6, 99])  # several tokens at once (after a verification)
    assert p.expected_accepted_tokens() == pytest.approx(0.0 + 0.5 * 2)


def test_host_probes_only_while_off_for_acceptance() -> None:
    p = policy(min_accepted_tokens_per_step=1.0, disable_by_batch_size=2)
    p.add_request("a")
    assert p.probes_wanted(1)  # nothing measured yet
    assert not p.probes_wanted(2)  # off for the batch size: probes would not turn it on
    p.observe("a", 3)
    assert not p.probes_wanted(1)  # on


def test_model_proposer_drafts_to_measure_then_probes_backing_off() -> None:
    """A model proposer's probe is a drafting step (and its pass catches up what the skipped
    passes did not write): each probe that leaves drafting off quadruples the steps to the
    next, up to 64 times probe_interval; drafting on for the acceptance resets the interval."""
    p = policy("draft_model", min_accepted_tokens_per_step=1.0, disable_by_batch_size=None,
               probe_interval=3)
    p.add_request("a")
    assert p.begin_step(1) is Drafting.ON  # nothing measured: draft to measure
    p.observe("a", 0)
    decisions = [p.begin_step(1) for _ in range(3 + 1 + 12 + 1 + 48 + 1 + 192 + 1 + 192 + 1)]
    off, on = Drafting.OFF_ACCEPTANCE, Drafting.ON
    assert decisions == ([off] * 3 + [on] + [off] * 12 + [on] + [off] * 48 + [on]
                         + [off] * 192 + [on] + [off] * 192 + [on])
    assert not p.probes_wanted(1)  # no host probes for a model proposer
    p.observe("a", 4)  # the probe found drafts accepted again: on
    assert p.begin_step(1) is Drafting.ON
    for _ in range(4):  # until the expectation falls below half the threshold
        p.observe("a", 0)
    decisions = [p.begin_step(1) for _ in range(5)]
    assert decisions == [off] * 3 + [on] + [off]  # back to probe_interval


def test_a_model_proposers_probe_is_announced_a_step_ahead() -> None:
    """With drafts proposed on the device, a probing step's drafts come from the step before
    it: the policy says after each step whether the next one probes."""
    p = policy("eagle", min_accepted_tokens_per_step=1.0, disable_by_batch_size=None,
               probe_interval=2)
    p.add_request("a")
    p.begin_step(1)
    p.observe("a", 0)
    announced = []
    for _ in range(13):
        decision = p.begin_step(1)
        announced.append((decision, p.probes_next_step()))
    off, on = Drafting.OFF_ACCEPTANCE, Drafting.ON
    assert announced == [
        (off, False), (off, True), (on, False),
        *[(off, False)] * 7, (off, True), (on, False),  # backed off: 8 steps to the next
        (off, False)]
    assert not policy(min_accepted_tokens_per_step=1.0).probes_next_step()  # n-gram: on host


def test_threshold_zero_always_drafts_below_the_batch_limit() -> None:
    p = policy(min_accepted_tokens_per_step=0, disable_by_batch_size=3)
    p.add_request("a")
    for _ in range(5):
        p.observe("a", 0)
    assert p.decide(2) is Drafting.ON and p.decide(3) is Drafting.OFF_BATCH_SIZE


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(), True),
    (SamplingParams(temperature=0.7, top_p=0.9, seed=3), True),
    (SamplingParams(logprobs=2), False),
    (SamplingParams(min_tokens=3), False),
    (SamplingParams(repetition_penalty=1.2), False),
    (SamplingParams(presence_penalty=0.5), False),
    (SamplingParams(logit_bias={5: 1.0}), False),
])
def test_only_requests_whose_drafts_verify_exactly_can_speculate(params: SamplingParams,
                                                                  expected: bool) -> None:
    assert can_speculate(params) is expected
