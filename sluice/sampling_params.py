"""Sampling parameters, shaped like vLLM's so that vLLM scripts run unchanged."""

from __future__ import annotations

import msgspec

# Greedy sampling is temperature below this.
_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """How to pick each next token, and when to stop.

    A msgspec struct: the one definition of a request's sampling parameters, in the offline
    API, on the wire to the engine core and in the step messages to the workers (decoding runs
    `__post_init__`, so a frame carrying bad values fails validation like a bad argument).

    `temperature == 0` is greedy. `top_k` of 0 or -1 disables top-k. `stop` strings are matched
    on the detokenized text and left out of the output (unless `include_stop_str_in_output`).
    `logprobs` / `prompt_logprobs` ask for the top-N log-probabilities of the model's raw
    distribution (before temperature and penalties), plus the chosen token's.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Filled from generation_config.json / the tokenizer by the input processor, not by users
    # (stop_token_ids are always among them).
    all_stop_token_ids: set[int] = msgspec.field(default_factory=set)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        self.all_stop_token_ids = set(self.all_stop_token_ids).union(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", self.repetition_penalty, "in (0, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or
                                      not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, value, f"an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (used to fan out `n > 1`)."""
        return msgspec.structs.replace(self, **changes)
