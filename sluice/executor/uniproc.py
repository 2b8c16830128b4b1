"""The executor of one worker in the engine's own process: calls go straight to it."""

from __future__ import annotations

from sluice.config import EngineConfig
from sluice.core.kv_connector import KVCacheSpec
from sluice.core.outputs import SchedulerOutput
from sluice.executor.base import Executor
from sluice.worker.model_runner import ModelRunner
from sluice.worker.profiler import ProfileSummary
from sluice.worker.step_handle import StepHandle
from sluice.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from sluice.kv_transfer.factory import worker_connector_factory

        self.worker: Worker | None = Worker(config, rank=0,
                                            connector_factory=worker_connector_factory(config))

    @property
    def model_runner(self) -> ModelRunner:
        return self.worker.model_runner

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheSpec:
        self.kv_cache_spec = self.worker.initialize_kv_cache(num_blocks)
        return self.kv_cache_spec

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        return self.worker.execute_model(scheduler_output)

    def start_profile(self) -> None:
        self.worker.start_profile()

    def stop_profile(self) -> list[ProfileSummary]:
        return [self.worker.stop_profile()]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
