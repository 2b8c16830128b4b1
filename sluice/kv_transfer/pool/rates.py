"""Whether loading a pool hit is expected to beat recomputing it, from rates this instance
measures itself (the scheduler half of the pool connector keeps one `LoadOrRecompute`).

    rates = LoadOrRecompute("auto", block_size=16)
    rates.step_done(seconds, num_tokens, had_loads)   # every step: the prefill rate
    rates.load_done(seconds, num_blocks)              # every step that loaded: the load rate
    rates.should_load(num_blocks)                     # a lookup found num_blocks blocks

- Recomputing: what one more token costs a step, the slope of a least-squares line through
  the recent steps that loaded nothing (time against tokens; a step's time is from its plan to
  its result, less any overlap with the step before under async scheduling). A step's fixed
  cost is paid whether the hit's tokens are in it or not: only the slope counts.
- Loading: a line through the recent loads (time against blocks: fetch, check and copy into
  the cache, every rank's time and blocks summed): a fixed cost per load and a cost per block.
- The choice: load when fixed + blocks x per-block <= blocks x block_size x per-token. Before
  both exist it loads (the first loads measure the pool). While loads are skipped the load line
  would go stale, so every `PROBE_EVERY`-th skip loads anyway.
- `policy`: "auto" (the above), "always", "never" (kv_connector_extra_config.load_policy).

Lines need samples of different sizes: until they have them (or when the fit comes out
negative), the line goes through the origin (total time over total size), which counts a
step's fixed cost into the cost per token and so errs toward loading. Attention's growth with
the context makes a long recompute dearer than the line says (toward recomputing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

LOAD_POLICIES = ("auto", "always", "never")
PROBE_EVERY = 16
_DECAY = 0.9  # each sample's weight, per newer sample
_MIN_SPREAD = 0.05  # relative variance of the sizes below which no slope is fitted


@dataclass(slots=True)
class Line:
    """Time against size, least squares over exponentially decaying samples."""

    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.weight = _DECAY * self.weight + 1.0
        self.sum_x = _DECAY * self.sum_x + x
        self.sum_y = _DECAY * self.sum_y + y
        self.sum_xx = _DECAY * self.sum_xx + x * x
        self.sum_xy = _DECAY * self.sum_xy + x * y

    @property
    def empty(self) -> bool:
        return self.weight == 0.0

    def fit(self) -> tuple[float, float]:
        """(intercept, slope), both >= 0; through the origin without enough spread."""
        spread = self.weight * self.sum_xx - self.sum_x ** 2
        if spread > _MIN_SPREAD * self.weight * self.sum_xx:
            slope = (self.weight * self.sum_xy - self.sum_x * self.sum_y) / spread
            intercept = (self.sum_y - slope * self.sum_x) / self.weight
            if slope > 0 and intercept >= 0:
                return intercept, slope
        return 0.0, self.sum_y / self.sum_x


class LoadOrRecompute:
    def __init__(self, policy: str, block_size: int) -> None:
        if policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {list(LOAD_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self.steps = Line()  # seconds against tokens
        self.loads = Line()  # seconds against blocks
        self.num_skipped = 0  # lookups whose hit was not loaded
        self._since_probe = 0
        self._last_result = 0.0

    def step_done(self, seconds: float, num_tokens: int, had_loads: bool) -> None:
        if not had_loads and num_tokens > 0 and seconds > 0:
            self.steps.add(num_tokens, seconds)

    def load_done(self, seconds: float, num_blocks: float) -> None:
        if num_blocks > 0 and seconds > 0:
            self.loads.add(num_blocks, seconds)

    def step_seconds(self, planned_at: float, now: float | None = None) -> float:
        """A step's time from its plan (`planned_at`) to its result now, less the part that
        overlapped the step before (whose result came after this one's plan)."""
        now = time.perf_counter() if now is None else now
        start = max(planned_at, self._last_result)
        self._last_result = now
        return now - start

    @property
    def seconds_per_token(self) -> float | None:
        return None if self.steps.empty else self.steps.fit()[1]

    @property
    def seconds_per_block(self) -> float | None:
        return None if self.loads.empty else self.loads.fit()[1]

    def expected_seconds(self, num_blocks: int) -> tuple[float, float] | None:
        """(loading, recomputing) `num_blocks` blocks by the current lines; None before both
        exist."""
        if self.steps.empty or self.loads.empty:
            return None
        fixed, per_block = self.loads.fit()
        return (fixed + num_blocks * per_block,
                num_blocks * self.block_size * self.steps.fit()[1])

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

    def _probe(self) -> bool:
        self._since_probe += 1
        if self._since_probe < PROBE_EVERY:
            return False
        self._since_probe = 0
        return True
