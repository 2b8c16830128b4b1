"""The messages between AsyncLLM (front end) and the engine-core process, and their encoding.

Frames are sluice.channel's typed, versioned messages: a frame of the wrong shape, an unknown
type or another schema version raises `WireError` saying what was wrong; the receiving loop logs
it and goes on. No pickle anywhere.

front end -> engine core: AddRequest ("add", an EngineCoreRequest), AbortRequests ("abort"),
FinishRequests ("finish": a stop string found by the front end), UtilityRequest ("utility").
engine core -> front end: Ready ("ready", once), EngineCoreOutputs ("outputs", every step),
UtilityReply ("utility_reply"), EngineDead ("dead", the last frame of a failing core).
"""

from __future__ import annotations

from sluice.channel import Message, MessageDecoder
from sluice.core.outputs import SCHEMA_VERSION, EngineCoreOutput
from sluice.core.request import EngineCoreRequest
from sluice.engine.stats import SchedulerStats

# The messages inside the frames are the engine's own structs (sluice/core/outputs.py,
# sluice/core/request.py): one definition each, one version for all of them.
WIRE_VERSION = SCHEMA_VERSION
_PEERS = "front end and engine core"

# Utility calls the engine core answers between steps, and what each returns:
# "stats" -> SchedulerStats, "reset_prefix_cache" -> bool (False while blocks are in use),
# "check_integrity" -> True (or an error naming the broken KV-cache invariant).
UTILITY_NAMES = ("stats", "reset_prefix_cache", "check_integrity")


# ---- front end -> engine core --------------------------------------------------------------


class AddRequest(Message, tag="add"):
    """One sample to generate (a request with `n > 1` is sent as n of these)."""

    request: EngineCoreRequest
    client: int = 0  # the front end that sent it (several API servers): gets its outputs


class AbortRequests(Message, tag="abort"):
    request_ids: list[str]


class FinishRequests(Message, tag="finish"):
    """Requests the front end ended on a stop string: finish them as stopped."""

    request_ids: list[str]


class UtilityRequest(Message, tag="utility"):
    call_id: int
    name: str
    client: int = 0  # the front end the reply goes to


# ---- engine core -> front end --------------------------------------------------------------


class Ready(Message, tag="ready"):
    num_blocks: int  # usable KV blocks (the null block left out)
    block_size: int
    max_model_len: int
    pid: int
    worker_pids: list[int] = []  # the executor's worker processes (none in-process)


class EngineCoreOutputs(Message, tag="outputs"):
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.time() in the engine core when the step ended


class UtilityReply(Message, tag="utility_reply"):
    call_id: int
    result: SchedulerStats | bool | int | str | None = None
    error: str | None = None  # set when the call failed; `result` is then None


class EngineDead(Message, tag="dead"):
    error: str  # "ExceptionType: message"
    traceback: str = ""


RequestMessage = AddRequest | AbortRequests | FinishRequests | UtilityRequest
ResponseMessage = Ready | EngineCoreOutputs | UtilityReply | EngineDead


class RequestDecoder(MessageDecoder):
    """Decodes what the engine core receives."""

    def __init__(self) -> None:
        super().__init__(RequestMessage, "request", _PEERS)

    def decode(self, frame: bytes | memoryview) -> RequestMessage:
        return super().decode(frame)  # type: ignore[return-value]


class ResponseDecoder(MessageDecoder):
    """Decodes what the front end receives."""

    def __init__(self) -> None:
        super().__init__(ResponseMessage, "response", _PEERS)

    def decode(self, frame: bytes | memoryview) -> ResponseMessage:
        return super().decode(frame)  # type: ignore[return-value]
