"""The executor: the engine core's one handle on its workers.

`UniprocExecutor` runs one worker in the engine's own process (the default, and today's fast
path); `MultiprocExecutor` runs one worker process per rank and sends every rank the same step
message. Both give the engine core the same calls, so the scheduler never knows where the model
runs: `determine_num_blocks` (the minimum over ranks), `initialize_kv_cache`, `kv_cache_spec`,
`execute_model` (returns at once; `.result()` of what it returns waits for the step),
`start_profile` / `stop_profile` (a torch.profiler window on every rank), `shutdown`.
`create_executor` (sluice/executor/factory.py) picks one by `distributed_executor_backend`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from sluice.config import EngineConfig
from sluice.core.kv_connector import KVCacheSpec
from sluice.core.outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from sluice.worker.profiler import ProfileSummary


class StepFuture(Protocol):
    def result(self) -> ModelRunnerOutput: ...

    def take_connector_output(self) -> KVConnectorOutput | None:
        """The step's connector report where it is known at launch (in-process workers), or
        None (then it comes with result())."""
        ...


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.kv_cache_spec: KVCacheSpec | None = None

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks that fit every rank (the minimum)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> KVCacheSpec:
        """Allocate the caches on every rank; the same block ids mean the same blocks on all."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Start one step on every rank; results are taken in launch order."""

    @abstractmethod
    def start_profile(self) -> None:
        """Start a torch.profiler window on every rank (after the steps already launched)."""

    @abstractmethod
    def stop_profile(self) -> list[ProfileSummary]:
        """End the window: every rank's summary, in rank order."""

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker is gone (for an idle engine: a busy one finds out
        in its next step)."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their memory; idempotent."""
