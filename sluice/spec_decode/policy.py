"""When to draft: the scheduler's drafting policy for speculative decoding.

A step with drafts verifies 1 + k tokens per request: with async scheduling (drafts proposed on
the device) it overlaps like any step, and costs more device time than a step
without (1.28x at batch 1 for Qwen3-0.6B on an H200); otherwise it runs
synchronously (how many drafts each request accepted decides where its next step starts, and its
next drafts continue from its last token), about two overlapped steps. Drafting pays only when
enough drafts are accepted, and less as the batch grows. Per step, `begin_step(batch_size)` says
whether the scheduler drafts:

- off while `disable_by_batch_size` or more requests run (vLLM's rule);
- off while the expected number of draft tokens accepted per request and step is below
  `min_accepted_tokens_per_step`: the mean, over the live requests that can speculate, of each
  request's exponential moving average of the draft tokens accepted in the steps that drafted
  for it (a step whose proposer found nothing counts 0). A request not yet measured counts as
  the average over every request so far. Once on, drafting stays on until the expectation falls
  below half the threshold: with synchronous drafting steps each switch costs a step's overlap
  twice (the step in flight is taken before drafting, and the step after a drafting one starts
  with the device idle), so a policy that flips on and off around one threshold pays that for
  nothing. Device drafts switch for free, but a lower threshold lost there too: the averages lag
  the output's repeats by a step or more (benchmarks/journal/
  2026-11-25-first-run-serving-speculation-h100.md, 2026-11-27-device-ngram-drafts.md).

While drafting is off for acceptance the averages are kept fresh by probes, one every
`probe_interval` steps of a request:
- n-gram drafts need nothing but the tokens, on the host: a probe proposes from the tokens
  known (`start_probe`) and compares the drafts with the tokens the request then gets
  (`observe_tokens`). That is what verification would accept: for greedy requests exactly, for
  sampled ones in distribution (a draft d is accepted with probability p(d), the chance that the
  token sampled instead is d; d's successor likewise, given d). The device never sees a probe.
- a model proposer's drafts need the device: after `probe_interval` steps off, one step drafts.
  With device drafts that step's drafts are proposed after the step before it
  (`probes_next_step`), and a step whose slots got no drafts (the step before did not propose)
  is not observed. Such a probe costs a drafting step and, since the proposer's pass is skipped
  while drafting is off, a catch-up of the positions since the last (several decode steps' worth
  at batch 1): each probe that leaves drafting off quadruples the steps to the next, up to 64
  times `probe_interval`, and drafting on for the acceptance resets it, because the probes of a
  fresh engine's first few hundred steps were most of the cost
  (benchmarks/journal/2026-11-28-first-use-stalls.md, its speculation section).

Lifecycle, driven by the scheduler: `add_request` for a request that can speculate
(`can_speculate`), `begin_step` once per scheduled step, `observe` per verified row (and for a
row the n-gram proposer found nothing for), `start_probe` (while `probes_wanted` and
`wants_probe`) and `observe_tokens` as a request's tokens come back, `remove_request` when the
request ends. Host-only, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sluice.sampling_params import SamplingParams
from sluice.spec_decode.config import SpeculativeConfig

# Weight of a new observation in a request's moving average (about the last 1 / w count): a step
# that drafted, and a probe (rarer, while drafting is off: each weighs more, so a request whose
# output starts repeating itself turns drafting on within a few probes); and in the average over
# all requests (the prior of a request not yet measured).
_REQUEST_EMA_WEIGHT = 0.25
_PROBE_EMA_WEIGHT = 0.5
_GLOBAL_EMA_WEIGHT = 0.05
# Drafting, once on for acceptance, stays on until the expectation falls below this fraction of
# min_accepted_tokens_per_step.
_STAY_ON_FRACTION = 0.5
# A model proposer's probes back off: each one that leaves drafting off multiplies the steps to
# the next by _PROBE_BACKOFF_FACTOR, up to _MAX_PROBE_BACKOFF times probe_interval (its probe is
# a drafting step, and its pass catches up the positions skipped since the last).
_PROBE_BACKOFF_FACTOR = 4
_MAX_PROBE_BACKOFF = 64


def can_speculate(params: SamplingParams) -> bool:
    """Whether drafts can be verified exactly for a request sampled with `params`. Token
    constraints (logit_bias, a structured-output grammar, whose mask is built for one position
    per step) are applied by the sampler alone: such requests decode without drafts. Penalties,
    min_tokens and logprobs depend on every position's tokens: likewise."""
    return (params.logprobs is None and not params.min_tokens and params.presence_penalty == 0
            and params.frequency_penalty == 0 and params.repetition_penalty == 1.0
            and not params.logit_bias and params.structured_outputs is None)


class Drafting(enum.Enum):
    """The policy's decision for one step, with the reason when off."""

    ON = "on"
    OFF_BATCH_SIZE = "off_batch_size"
    OFF_ACCEPTANCE = "off_acceptance"
    IDLE = "idle"  # no request that can speculate


@dataclass(slots=True)
class _Probe:
    drafts: list[int]  # what the proposer would have drafted after the tokens known then
    num_matched: int = 0  # of those, the leading ones the request's next tokens equalled


class DraftingPolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.disable_by_batch_size = config.disable_by_batch_size
        self.min_accepted = config.min_accepted_tokens_per_step
        self.probe_interval = config.probe_interval
        # n-gram probes run on the host; a model proposer's probe is a step that drafts.
        self.probes_on_host = config.method == "ngram"
        self._live: set[str] = set()
        self._ema: dict[str, float] = {}  # per live request with an observation
        self._ema_sum = 0.0  # sum of _ema's values
        self._global_ema: float | None = None
        self._probes: dict[str, _Probe] = {}
        self._steps_to_probe: dict[str, int] = {}  # host probes: per request
        self._steps_since_drafting = 0  # model probes: steps off since the last one drafting
        self._model_probe_interval = self.probe_interval  # steps off before the next
        self._on = False  # whether the last counted step drafted (hysteresis)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, req_id: str) -> None:
        self._live.add(req_id)
        self._steps_to_probe[req_id] = 0

    def remove_request(self, req_id: str) -> None:
        if req_id not in self._live:
            return
        self._live.discard(req_id)
        ema = self._ema.pop(req_id, None)
        if ema is not None:
            self._ema_sum -= ema
        if not self._ema:
            self._ema_sum = 0.0  # no drift from float sums over a long run
        self._probes.pop(req_id, None)
        self._steps_to_probe.pop(req_id, None)

    def tracks(self, req_id: str) -> bool:
        """Whether the request can speculate (it was added and has not ended)."""
        return req_id in self._live

    # ---- the decision --------------------------------------------------------------------

    def expected_accepted_tokens(self) -> float | None:
        """Draft tokens a drafting step is expected to get accepted per live request; None
        before any observation."""
        num_known = len(self._ema)
        if self._global_ema is None:
            return self._ema_sum / num_known if num_known else None
        num_unknown = len(self._live) - num_known
        return (self._ema_sum + num_unknown * self._global_ema) / len(self._live)

    def decide(self, batch_size: int) -> Drafting:
        """This step's decision for `batch_size` running requests, without counting the step
        (begin_step counts it)."""
        return self._decide(batch_size)[0]

    def _decide(self, batch_size: int) -> tuple[Drafting, bool]:
        """(the decision, whether it is a model proposer's probe)."""
        if batch_size == 0 or not self._live:
            return Drafting.IDLE, False
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            return Drafting.OFF_BATCH_SIZE, False
        if self.min_accepted == 0:
            return Drafting.ON, False
        expected = self.expected_accepted_tokens()
        if expected is None:
            # Nothing measured yet: a model proposer drafts to measure; n-gram probes on the host.
            return (Drafting.OFF_ACCEPTANCE if self.probes_on_host else Drafting.ON), False
        threshold = self.min_accepted * (_STAY_ON_FRACTION if self._on else 1.0)
        if expected >= threshold:
            return Drafting.ON, False
        if self._model_probe_due():
            return Drafting.ON, True
        return Drafting.OFF_ACCEPTANCE, False

    def _model_probe_due(self) -> bool:
        return (not self.probes_on_host
                and self._steps_since_drafting >= self._model_probe_interval)

    def probes_next_step(self) -> bool:
        """A model proposer's: whether the next step probes if drafting stays off for
        acceptance (its drafts must be proposed after this one)."""
        return not self._on and self._model_probe_due()

    def wants_drafts(self, batch_size: int) -> bool:
        return self.decide(batch_size) is Drafting.ON

    def begin_step(self, batch_size: int) -> Drafting:
        """Decide for the step being scheduled, and count it."""
        decision, probe = self._decide(batch_size)
        self._on = decision is Drafting.ON
        if decision is Drafting.ON:
            # Each model probe multiplies the interval to the next (up to _MAX_PROBE_BACKOFF
            # times probe_interval); drafting on for the acceptance resets it.
            self._model_probe_interval = (
                min(_PROBE_BACKOFF_FACTOR * self._model_probe_interval,
                    _MAX_PROBE_BACKOFF * self.probe_interval)
                if probe else self.probe_interval)
            self._steps_since_drafting = 0
            self._probes.clear()  # real drafts measure now
        elif decision is Drafting.OFF_ACCEPTANCE:
            self._steps_since_drafting += 1
        return decision

    # ---- what happened -------------------------------------------------------------------

    def observe(self, req_id: str, num_accepted: int,
                weight: float = _REQUEST_EMA_WEIGHT) -> None:
        """A step that drafted for the request (or a probe of it) got `num_accepted` of its
        draft tokens accepted (0 when the proposer found none)."""
        if req_id not in self._live:
            return
        old = self._ema.get(req_id)
        if old is None:
            prior = self._global_ema
            new = float(num_accepted) if prior is None else (
                prior + weight * (num_accepted - prior))
            self._ema_sum += new
        else:
            new = old + weight * (num_accepted - old)
            self._ema_sum += new - old
        self._ema[req_id] = new
        self._global_ema = float(num_accepted) if self._global_ema is None else (
            self._global_ema + _GLOBAL_EMA_WEIGHT * (num_accepted - self._global_ema))

    def probes_wanted(self, batch_size: int) -> bool:
        """Whether host probes should start now: n-gram, and drafting off for acceptance at
        this batch size."""
        return self.probes_on_host and self.decide(batch_size) is Drafting.OFF_ACCEPTANCE

    def has_probes(self) -> bool:
        """Whether host probes are in progress (the request's next tokens settle them)."""
        return bool(self._probes)

    def wants_probe(self, req_id: str) -> bool:
        """Whether to start a host probe for the request now (none in progress, its interval
        elapsed), when probes_wanted. Counts the request's step."""
        if req_id not in self._live or req_id in self._probes:
            return False
        steps = self._steps_to_probe[req_id]
        if steps > 0:
            self._steps_to_probe[req_id] = steps - 1
            return False
        return True

    def start_probe(self, req_id: str, drafts: list[int]) -> None:
        """The drafts the proposer makes from the request's tokens known now; the request's
        next tokens settle them (observe_tokens)."""
        self._steps_to_probe[req_id] = self.probe_interval
        if not drafts:
            self.observe(req_id, 0, _PROBE_EMA_WEIGHT)
            return
        self._probes[req_id] = _Probe(list(drafts))

    def observe_tokens(self, req_id: str, token_ids: list[int]) -> None:
        """The request's next tokens, in order: they settle its probe in progress."""
        probe = self._probes.get(req_id)
        if probe is None:
            return
        for token_id in token_ids:
            if token_id != probe.drafts[probe.num_matched]:
                break
            probe.num_matched += 1
            if probe.num_matched == len(probe.drafts):
                break
        else:
            return  # every token matched and drafts remain: wait for more
        del self._probes[req_id]
        self.observe(req_id, probe.num_matched, _PROBE_EMA_WEIGHT)
