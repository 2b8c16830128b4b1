"""The frames between the multiprocess executor and its worker processes (sluice.channel's
typed, versioned messages; the step messages inside are the engine's own structs).

executor -> worker: Startup (once: the whole EngineConfig and the rank), DetermineNumBlocks,
InitializeKVCache, ExecuteModel (every step, the same frame to every rank), StartProfile,
StopProfile, Shutdown.
worker -> executor: WorkerReady, NumBlocks, KVCacheReady, StepResult (every step, every rank,
in step order), ProfileStarted, ProfileReady, WorkerFailed (the last frame of a failing worker).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from sluice.channel import Message, MessageDecoder
from sluice.config import EngineConfig
from sluice.core.kv_connector import KVCacheSpec
from sluice.core.outputs import ModelRunnerOutput, SchedulerOutput
from sluice.worker.profiler import ProfileSummary

ConnectorMetadataT = TypeVar("ConnectorMetadataT")
_PEERS = "the executor and its workers"


class Startup(Message, tag="startup"):
    config: EngineConfig
    rank: int
    world_size: int
    # At tensor_parallel_size > 1: the loopback port of the executor's TCPStore, where the
    # ranks meet to make their process group (sluice.distributed.tp); 0: no group.
    tp_store_port: int = 0


class DetermineNumBlocks(Message, tag="determine_num_blocks"):
    pass


class InitializeKVCache(Message, tag="initialize_kv_cache"):
    num_blocks: int


class ExecuteModel(Message, Generic[ConnectorMetadataT], tag="execute_model"):
    step_id: int
    scheduler_output: SchedulerOutput[ConnectorMetadataT]


class StartProfile(Message, tag="start_profile"):
    pass


class StopProfile(Message, tag="stop_profile"):
    pass


class Shutdown(Message, tag="shutdown"):
    pass


class WorkerReady(Message, tag="worker_ready"):
    rank: int
    pid: int


class NumBlocks(Message, tag="num_blocks"):
    rank: int
    num_blocks: int


class KVCacheReady(Message, tag="kv_cache_ready"):
    rank: int
    kv_cache_spec: KVCacheSpec


class StepResult(Message, tag="step_result"):
    rank: int
    step_id: int
    output: ModelRunnerOutput


class ProfileStarted(Message, tag="profile_started"):
    rank: int


class ProfileReady(Message, tag="profile_ready"):
    rank: int
    summary: ProfileSummary


class WorkerFailed(Message, tag="worker_failed"):
    rank: int
    error: str  # "ExceptionType: message"
    traceback: str = ""


WorkerReply = (WorkerReady | NumBlocks | KVCacheReady | StepResult | ProfileStarted
               | ProfileReady | WorkerFailed)


def worker_request_decoder(metadata_type: type) -> MessageDecoder:
    """What a worker receives; steps carry the configured connector's plan type."""
    return MessageDecoder(Startup | DetermineNumBlocks | InitializeKVCache
                          | ExecuteModel[metadata_type] | StartProfile  # type: ignore[valid-type]
                          | StopProfile | Shutdown,
                          "worker request", _PEERS)


def worker_reply_decoder() -> MessageDecoder:
    return MessageDecoder(WorkerReply, "worker reply", _PEERS)
