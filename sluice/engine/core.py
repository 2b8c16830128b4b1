"""EngineCore: one loop of schedule -> execute -> update, over requests already tokenized."""

from __future__ import annotations

import gc
from collections.abc import Iterable

from sluice.config import CacheConfig, ModelConfig, SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.outputs import EngineCoreOutput, SchedulerOutput
from sluice.core.request import Request, RequestStatus
from sluice.core.scheduler import Scheduler
from sluice.model.hf_config import HFModelConfig
from sluice.worker.model_runner import ModelRunner
from sluice.worker.step_handle import StepHandle


class EngineCore:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, hf_config: HFModelConfig) -> None:
        self.model_runner = ModelRunner(model_config, cache_config, scheduler_config, hf_config)
        num_blocks = self.model_runner.determine_num_blocks()
        # One request at max_model_len must fit on its own, or it could never be scheduled.
        blocks_per_seq = -(-scheduler_config.max_model_len // cache_config.block_size)
        if blocks_per_seq > num_blocks - 1:
            raise ValueError(
                f"max_model_len ({scheduler_config.max_model_len}) needs {blocks_per_seq} KV "
                f"blocks but the cache has {num_blocks - 1}: lower max_model_len or give the "
                "KV cache more memory (num_gpu_blocks_override / gpu_memory_utilization)")
        self.model_runner.initialize_kv_cache(num_blocks)
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self.async_scheduling = scheduler_config.async_scheduling
        self.in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        # Everything built so far (blocks, model, graphs) lives as long as the engine: keep it
        # out of the cyclic collector, whose full passes would otherwise walk every block.
        gc.collect()
        gc.freeze()

    def shutdown(self) -> None:
        """Give back the device memory (CUDA graphs, KV cache, weights) now. The engine's
        objects were frozen out of the cyclic collector at start-up, so dropping the last
        reference alone would not free them; unfreeze so the rest can be collected."""
        self.in_flight = None
        self.model_runner.shutdown()
        gc.unfreeze()
        gc.collect()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """One step. With async scheduling, launch the next step before taking the results
        of the one in flight, so scheduling and output handling overlap the device; outputs
        then trail by one step, and a request that stopped may have computed one token more
        (discarded)."""
        launched = None
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty:
                launched = (scheduler_output, self.model_runner.launch(scheduler_output))
            elif scheduler_output.finished_req_ids:
                self.model_runner.launch(scheduler_output)  # only drops their state
            if scheduler_output.is_empty and self.in_flight is None:
                # Cannot happen while one max_model_len request fits the cache; never spin.
                raise RuntimeError(f"scheduler made no progress with "
                                   f"{self.scheduler.get_num_unfinished_requests()} requests")
        outputs: list[EngineCoreOutput] = []
        if self.in_flight is not None:
            scheduler_output, handle = self.in_flight
            outputs = self.scheduler.update_from_output(scheduler_output, handle.result())
            self.in_flight = None
        if launched is not None:
            if self.async_scheduling:
                self.in_flight = launched
            else:
                scheduler_output, handle = launched
                outputs = self.scheduler.update_from_output(scheduler_output, handle.result())
        return outputs
