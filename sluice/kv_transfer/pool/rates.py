"""Whether loading a pool hit is expected to beat recomputing it, from rates this instance
measures itself (the scheduler half of the pool connector keeps one `LoadOrRecompute`).

    rates = LoadOrRecompute("auto", block_size=16)
    rates.step_done(seconds, num_tokens, had_loads)   # every step: the prefill rate
    rates.load_done(seconds, num_blocks)              # every step that loaded: the load rate
    rates.should_load(num_blocks)                     # a lookup found num_blocks blocks

- Recomputing: seconds per token, a moving average over steps of at least `MIN_STEP_TOKENS`
  tokens that loaded nothing (shorter steps are mostly fixed overhead). A step's time is from
  its plan to its result, less any overlap with the step before (async scheduling).
- Loading: seconds per block of this instance's backend, a moving average over the worker's
  loads (fetch, check and copy into the cache; every rank's time and blocks summed).
- The choice: load when blocks x s/block <= blocks x block_size x s/token. Before both rates
  exist it loads (the first loads measure the pool). While loads are skipped the load rate
  would go stale, so every `PROBE_EVERY`-th skip loads anyway.
- `policy`: "auto" (the above), "always", "never" (kv_connector_extra_config.load_policy).

Both rates are linear: a per-call latency of the pool weighs less in a long hit than the model
says, and attention's growth with the context makes a long recompute dearer than the average;
both err toward recomputing long prompts.
"""

from __future__ import annotations

import time

LOAD_POLICIES = ("auto", "always", "never")
MIN_STEP_TOKENS = 64
PROBE_EVERY = 16
_WEIGHT = 0.25  # of the newest sample in each moving average


class LoadOrRecompute:
    def __init__(self, policy: str, block_size: int) -> None:
        if policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {list(LOAD_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self.seconds_per_token: float | None = None
        self.seconds_per_block: float | None = None
        self.num_skipped = 0  # lookups whose hit was not loaded
        self._since_probe = 0
        self._last_result = 0.0

    def step_done(self, seconds: float, num_tokens: int, had_loads: bool) -> None:
        if had_loads or num_tokens < MIN_STEP_TOKENS or seconds <= 0:
            return
        self.seconds_per_token = _average(self.seconds_per_token, seconds / num_tokens)

    def load_done(self, seconds: float, num_blocks: float) -> None:
        if num_blocks <= 0 or seconds <= 0:
            return
        self.seconds_per_block = _average(self.seconds_per_block, seconds / num_blocks)

    def step_seconds(self, planned_at: float, now: float | None = None) -> float:
        """A step's time from its plan (`planned_at`) to its result now, less the part that
        overlapped the step before (whose result came after this one's plan)."""
        now = time.perf_counter() if now is None else now
        start = max(planned_at, self._last_result)
        self._last_result = now
        return now - start

    def should_load(self, num_blocks: int) -> bool:
        expected = self.expected_seconds(num_blocks)
        if self.policy != "auto":
            load = self.policy == "always"
        elif expected is None:
            load = True
        else:
            load = expected[0] <= expected[1] or self._probe()
        if not load:
            self.num_skipped += 1
        return load

    def expected_seconds(self, num_blocks: int) -> tuple[float, float] | None:
        """(loading, recomputing) `num_blocks` blocks by the current rates; None before both
        exist."""
        if self.seconds_per_token is None or self.seconds_per_block is None:
            return None
        return (num_blocks * self.seconds_per_block,
                num_blocks * self.block_size * self.seconds_per_token)

    def _probe(self) -> bool:
        self._since_probe += 1
        if self._since_probe < PROBE_EVERY:
            return False
        self._since_probe = 0
        return True


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _WEIGHT) * old + _WEIGHT * sample
