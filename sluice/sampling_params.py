"""Sampling parameters, shaped like vLLM's so that vLLM scripts run unchanged."""

from __future__ import annotations

import math
from typing import Any

import msgspec

# Greedy sampling is temperature below this.
_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What a reply must match (vLLM's `StructuredOutputsParams`): exactly one of a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular expression
    (`regex`), one of a list of strings (`choice`), an EBNF grammar in xgrammar's dialect
    (`grammar`) or an xgrammar structural tag (`structural_tag`, its JSON text: how tool
    calls are constrained). `disable_any_whitespace` makes JSON compact, with no whitespace
    between its tokens (small models otherwise may loop on whitespace).

    Checked for shape here; whether a schema, regex or grammar compiles is checked where the
    request enters the engine (sluice/structured_output/grammar.py)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object, structural_tag; got {kinds or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")

    @property
    def kind(self) -> str:
        """Which of the fields is set: "json", "regex", "choice", "grammar", "json_object" or
        "structural_tag"."""
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """How to pick each next token, and when to stop.

    A msgspec struct: the one definition of a request's sampling parameters, in the offline
    API, on the wire to the engine core and in the step messages to the workers (decoding runs
    `__post_init__`, so a frame carrying bad values fails validation like a bad argument).

    `temperature == 0` is greedy. `top_k` of 0 or -1 disables top-k. `stop` strings are matched
    on the detokenized text and left out of the output (unless `include_stop_str_in_output`).
    `logprobs` / `prompt_logprobs` ask for the top-N log-probabilities of the model's raw
    distribution (before temperature, penalties, logit_bias and grammar masks), plus the chosen
    token's. `structured_outputs` constrains the reply to a JSON schema, regex, choice or
    grammar (see StructuredOutputsParams).
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
    # token id -> added to its logit before sampling, in [-100, 100] (OpenAI's); not seen by
    # logprobs, which are of the raw distribution.
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
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
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    raise bad("logit_bias", token_id, "keyed by token ids (integers >= 0)")
                if (not isinstance(bias, (int, float)) or not math.isfinite(bias)
                        or abs(bias) > MAX_LOGIT_BIAS):
                    raise bad("logit_bias", bias, f"values in [-{MAX_LOGIT_BIAS:g}, "
                                                  f"{MAX_LOGIT_BIAS:g}] (token {token_id})")
        if self.structured_outputs is not None and self.min_tokens:
            # The grammar may allow only the end of the reply while min_tokens forbids it.
            raise bad("min_tokens", self.min_tokens, "0 with structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (used to fan out `n > 1`)."""
        return msgspec.structs.replace(self, **changes)
