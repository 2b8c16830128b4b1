"""The messages between AsyncLLM (front end) and the engine-core process, and their encoding.

Every frame is one msgpack map encoded by msgspec from a tagged Struct: `type` names the message,
`version` is WIRE_VERSION. Decoding is typed (the receiving side names the union it accepts), so
a frame of the wrong shape, an unknown type or another schema version raises `WireError` with
what was wrong; the receiving loop logs it and goes on. No pickle anywhere.

front end -> engine core: EngineCoreRequest ("add"), AbortRequests ("abort"), FinishRequests
("finish": a stop string found by the front end), UtilityRequest ("utility").
engine core -> front end: Ready ("ready", once), EngineCoreOutputs ("outputs", every step),
UtilityReply ("utility_reply"), EngineDead ("dead", the last frame of a failing core).
"""

from __future__ import annotations

import msgspec

from sluice.core.outputs import EngineCoreOutput, PositionLogprobs
from sluice.core.request import Request
from sluice.engine.stats import SchedulerStats
from sluice.sampling_params import SamplingParams

# 2: SchedulerStats carries the speculative-decoding counters (spec_*).
WIRE_VERSION = 2

# Utility calls the engine core answers between steps, and what each returns:
# "stats" -> SchedulerStats, "reset_prefix_cache" -> bool (False while blocks are in use),
# "check_integrity" -> True (or an error naming the broken KV-cache invariant).
UTILITY_NAMES = ("stats", "reset_prefix_cache", "check_integrity")


class WireError(ValueError):
    """A frame that is not a valid message of the expected kind."""


class WireVersionError(WireError):
    """A frame of another schema version."""


class _Message(msgspec.Struct, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    version: int = WIRE_VERSION


# ---- payloads ------------------------------------------------------------------------------


class SamplingParamsWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """sluice.sampling_params.SamplingParams, field for field (sets become sorted lists)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    max_tokens: int | None
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    all_stop_token_ids: list[int]

    @classmethod
    def from_params(cls, p: SamplingParams) -> SamplingParamsWire:
        return cls(
            n=p.n, temperature=float(p.temperature), top_p=float(p.top_p), top_k=p.top_k,
            min_p=float(p.min_p), seed=p.seed, presence_penalty=float(p.presence_penalty),
            frequency_penalty=float(p.frequency_penalty),
            repetition_penalty=float(p.repetition_penalty), stop=list(p.stop or []),
            stop_token_ids=list(p.stop_token_ids or []), ignore_eos=p.ignore_eos,
            max_tokens=p.max_tokens, min_tokens=p.min_tokens, logprobs=p.logprobs,
            prompt_logprobs=p.prompt_logprobs, skip_special_tokens=p.skip_special_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output,
            all_stop_token_ids=sorted(p.all_stop_token_ids),
        )

    def to_params(self) -> SamplingParams:
        fields = {f: getattr(self, f) for f in self.__struct_fields__
                  if f != "all_stop_token_ids"}
        params = SamplingParams(**fields)
        params.all_stop_token_ids = set(self.all_stop_token_ids)
        return params


class PositionLogprobsWire(msgspec.Struct, array_like=True, frozen=True,
                           forbid_unknown_fields=True):
    """One position's top logprobs as parallel lists, in the engine's order."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    @classmethod
    def from_dict(cls, position: PositionLogprobs) -> PositionLogprobsWire:
        return cls(list(position), [lp for lp, _ in position.values()],
                   [rank for _, rank in position.values()])

    def __post_init__(self) -> None:  # also runs on decode: a bad frame fails there
        if not len(self.token_ids) == len(self.logprobs) == len(self.ranks):
            raise ValueError(f"logprob lists differ in length: {len(self.token_ids)} token ids, "
                             f"{len(self.logprobs)} logprobs, {len(self.ranks)} ranks")

    def to_dict(self) -> PositionLogprobs:
        return {t: (lp, r) for t, lp, r in zip(self.token_ids, self.logprobs, self.ranks)}


class EngineCoreOutputItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """sluice.core.outputs.EngineCoreOutput on the wire."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[PositionLogprobsWire] | None = None
    new_prompt_logprobs: list[PositionLogprobsWire | None] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None

    @classmethod
    def from_output(cls, out: EngineCoreOutput) -> EngineCoreOutputItem:
        return cls(
            req_id=out.req_id,
            new_token_ids=out.new_token_ids,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            new_logprobs=(None if out.new_logprobs is None else
                          [PositionLogprobsWire.from_dict(p) for p in out.new_logprobs]),
            new_prompt_logprobs=(
                None if out.new_prompt_logprobs is None else
                [None if p is None else PositionLogprobsWire.from_dict(p)
                 for p in out.new_prompt_logprobs]),
            num_cached_tokens=out.num_cached_tokens,
            first_scheduled_time=out.first_scheduled_time,
        )

    def to_output(self) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=self.req_id,
            new_token_ids=list(self.new_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            new_logprobs=(None if self.new_logprobs is None else
                          [p.to_dict() for p in self.new_logprobs]),
            new_prompt_logprobs=(
                None if self.new_prompt_logprobs is None else
                [None if p is None else p.to_dict() for p in self.new_prompt_logprobs]),
            num_cached_tokens=self.num_cached_tokens,
            first_scheduled_time=self.first_scheduled_time,
        )


# ---- front end -> engine core --------------------------------------------------------------


class EngineCoreRequest(_Message, tag="add"):
    """One sample to generate (a request with `n > 1` is sent as n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParamsWire
    eos_token_ids: list[int]
    arrival_time: float
    max_tokens: int

    @classmethod
    def from_request(cls, request: Request) -> EngineCoreRequest:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=SamplingParamsWire.from_params(request.sampling_params),
            eos_token_ids=sorted(request.eos_token_ids),
            arrival_time=request.arrival_time,
            max_tokens=request.max_tokens,
        )

    def to_request(self) -> Request:
        return Request(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params.to_params(),
            eos_token_ids=set(self.eos_token_ids),
            arrival_time=self.arrival_time,
            max_tokens=self.max_tokens,
        )


class AbortRequests(_Message, tag="abort"):
    request_ids: list[str]


class FinishRequests(_Message, tag="finish"):
    """Requests the front end ended on a stop string: finish them as stopped."""

    request_ids: list[str]


class UtilityRequest(_Message, tag="utility"):
    call_id: int
    name: str


# ---- engine core -> front end --------------------------------------------------------------


class Ready(_Message, tag="ready"):
    num_blocks: int  # usable KV blocks (the null block left out)
    block_size: int
    max_model_len: int
    pid: int


class EngineCoreOutputs(_Message, tag="outputs"):
    outputs: list[EngineCoreOutputItem]
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.time() in the engine core when the step ended


class UtilityReply(_Message, tag="utility_reply"):
    call_id: int
    result: SchedulerStats | bool | int | str | None = None
    error: str | None = None  # set when the call failed; `result` is then None


class EngineDead(_Message, tag="dead"):
    error: str  # "ExceptionType: message"
    traceback: str = ""


RequestMessage = EngineCoreRequest | AbortRequests | FinishRequests | UtilityRequest
ResponseMessage = Ready | EngineCoreOutputs | UtilityReply | EngineDead


class _VersionProbe(msgspec.Struct):
    """Reads only `version` from any map frame, to tell a version mismatch from a bad frame."""

    version: int | None = None


class _Decoder:
    def __init__(self, message_type: object, kind: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._probe = msgspec.msgpack.Decoder(_VersionProbe)
        self._kind = kind

    def decode(self, frame: bytes | memoryview) -> object:
        try:
            message = self._decoder.decode(frame)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._check_version(frame)
            raise WireError(f"malformed {self._kind} frame ({len(frame)} bytes): {exc}") from None
        if message.version != WIRE_VERSION:
            raise WireVersionError(self._version_text(message.version))
        return message

    def _check_version(self, frame: bytes | memoryview) -> None:
        try:
            version = self._probe.decode(frame).version
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        if version is not None and version != WIRE_VERSION:
            raise WireVersionError(self._version_text(version)) from None

    def _version_text(self, version: object) -> str:
        return (f"{self._kind} frame has wire schema version {version!r}, this side speaks "
                f"version {WIRE_VERSION}: front end and engine core are from different sluice "
                "versions")


class RequestDecoder(_Decoder):
    """Decodes what the engine core receives."""

    def __init__(self) -> None:
        super().__init__(RequestMessage, "request")

    def decode(self, frame: bytes | memoryview) -> RequestMessage:
        return super().decode(frame)  # type: ignore[return-value]


class ResponseDecoder(_Decoder):
    """Decodes what the front end receives."""

    def __init__(self) -> None:
        super().__init__(ResponseMessage, "response")

    def decode(self, frame: bytes | memoryview) -> ResponseMessage:
        return super().decode(frame)  # type: ignore[return-value]


class Encoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: _Message) -> bytes:
        return self._encoder.encode(message)
