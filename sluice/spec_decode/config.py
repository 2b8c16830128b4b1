"""Speculative decoding configuration.

Users pass `speculative_config={...}` to `LLM(...)` or `--speculative-config JSON` to the CLI;
`SpeculativeConfig.from_dict` validates either once into a frozen `SpeculativeConfig`. Names and
n-gram defaults follow vLLM: with neither `prompt_lookup_min` nor `prompt_lookup_max` given both
are 5, with one given the other takes its value.

The drafting policy's fields (sluice/spec_decode/policy.py) say when drafting stops:
`disable_by_batch_size` (vLLM's name: no drafts while at least this many requests run; None: never
off for the batch size), `min_accepted_tokens_per_step` (no drafts while the draft tokens accepted
per request and step, a moving average, stay below it; 0: never off for acceptance; unset: 1.25, or
k when k is 1) and `probe_interval` (steps between the checks that turn drafting back on; unset: 2
for n-gram, whose checks run on the host, 16 for a model proposer, whose checks are steps that
draft, and back off up to 64 times that while they find nothing). The defaults follow from a
verification step's cost: about two overlapped steps when synchronous, 1.2-1.3 decode steps with
drafts on the device, so drafting pays at batch 1, and there from about one accepted draft token
per step (benchmarks/journal/2026-11-22-ngram-speculation-first-measurements.md,
2026-11-27-device-ngram-drafts.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from sluice.validation import verify_positive

SpeculativeMethod = Literal["ngram", "draft_model", "eagle"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)
# Methods whose drafts come from a model loaded from `model`.
MODEL_METHODS: tuple[str, ...] = ("draft_model", "eagle")
DEFAULT_PROMPT_LOOKUP = 5
DEFAULT_DISABLE_BY_BATCH_SIZE = 2
DEFAULT_MIN_ACCEPTED_TOKENS_PER_STEP = 1.25
# N-gram probes cost host time only; a model proposer's probe is a step that drafts.
DEFAULT_PROBE_INTERVAL = {"ngram": 2, "draft_model": 16, "eagle": 16}


def _allowed(values: tuple[str, ...]) -> str:
    return ", ".join(repr(v) for v in values)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod
    # Draft tokens proposed per request per step (k); the target verifies 1 + k tokens.
    num_speculative_tokens: int
    # Draft model or EAGLE head folder; required for those methods, refused for "ngram".
    model: str | None = None
    # N-gram sizes tried, longest first ("ngram" only; None for the other methods).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # Drafting policy. No drafts while this many requests or more run (None: any batch size).
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # No drafts while the expected draft tokens accepted per request and step are below this
    # (0: whatever the acceptance); at most num_speculative_tokens. None: 1.25, or k if smaller.
    min_accepted_tokens_per_step: float | None = None
    # While drafting is off for acceptance: steps between the probes that measure it again.
    # None: 2 for ngram (probes on the host), 16 for a model proposer (a probe drafts).
    probe_interval: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {_allowed(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        verify_positive("speculative_config.num_speculative_tokens", self.num_speculative_tokens)
        self._check_model()
        if self.method == "ngram":
            self._resolve_prompt_lookup()
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if value is not None:
                    raise ValueError(
                        f"speculative_config.{name} applies only to method 'ngram', "
                        f"got {value!r} with method {self.method!r}"
                    )
        self._check_policy()

    def _check_model(self) -> None:
        model = self.model
        if self.method in MODEL_METHODS:
            if isinstance(model, os.PathLike):
                model = os.fspath(model)
                object.__setattr__(self, "model", model)
            if not isinstance(model, str) or not model:
                raise ValueError(
                    f"speculative_config.model is required for method {self.method!r}: "
                    f"the path of a model folder, got {model!r}"
                )
        elif model is not None:
            raise ValueError(
                f"speculative_config.model is not allowed for method {self.method!r} "
                f"(it drafts from the sequence itself), got {model!r}"
            )

    def _check_policy(self) -> None:
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                                 or size < 2):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be an integer >= 2 (drafting "
                f"stops while that many requests run) or None (never), got {size!r}")
        threshold = self.min_accepted_tokens_per_step
        k = self.num_speculative_tokens
        if threshold is None:
            threshold = min(DEFAULT_MIN_ACCEPTED_TOKENS_PER_STEP, k)
        if (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                or not 0 <= threshold <= k):
            raise ValueError(
                f"speculative_config.min_accepted_tokens_per_step must be a number in "
                f"[0, num_speculative_tokens={k}], got {threshold!r}")
        object.__setattr__(self, "min_accepted_tokens_per_step", float(threshold))
        if self.probe_interval is None:
            object.__setattr__(self, "probe_interval", DEFAULT_PROBE_INTERVAL[self.method])
        verify_positive("speculative_config.probe_interval", self.probe_interval)

    def _resolve_prompt_lookup(self) -> None:
        lookup_min, lookup_max = self.prompt_lookup_min, self.prompt_lookup_max
        verify_positive("speculative_config.prompt_lookup_min", lookup_min, allow_none=True)
        verify_positive("speculative_config.prompt_lookup_max", lookup_max, allow_none=True)
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        elif lookup_min is None:
            lookup_min = lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        assert lookup_min is not None and lookup_max is not None
        if lookup_min > lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min must be <= prompt_lookup_max, "
                f"got prompt_lookup_min={lookup_min}, prompt_lookup_max={lookup_max}"
            )
        object.__setattr__(self, "prompt_lookup_min", lookup_min)
        object.__setattr__(self, "prompt_lookup_max", lookup_max)

    @classmethod
    def from_dict(
        cls, spec: dict[str, Any] | str | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """The config from `LLM(speculative_config=...)` or `--speculative-config JSON`.

        None (or the JSON `null`) means no speculation. Unknown keys are errors, not ignored,
        so a misspelt option never silently turns speculation into something else.
        """
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {spec!r}") from e
            if spec is None:
                return None
        if not isinstance(spec, dict):
            raise ValueError(
                "speculative_config must be a dict, a JSON object string or None, "
                f"got {type(spec).__name__}: {spec!r}"
            )
        allowed_keys = tuple(f.name for f in fields(cls))
        unknown = [key for key in spec if key not in allowed_keys]
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {_allowed(tuple(map(str, unknown)))}; "
                f"allowed keys: {_allowed(allowed_keys)}"
            )
        if "method" not in spec:
            raise ValueError(
                f"speculative_config.method is required: one of {_allowed(SPECULATIVE_METHODS)}"
            )
        if "num_speculative_tokens" not in spec:
            raise ValueError(
                "speculative_config.num_speculative_tokens is required: an integer >= 1"
            )
        return cls(**spec)
