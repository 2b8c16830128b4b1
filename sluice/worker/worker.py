"""One rank of the engine: its model runner and its half of the KV connector.

The executor (sluice/executor/) drives workers through the same calls whether they live in the
engine's process or each in their own: `determine_num_blocks` (what fits this rank), then
`initialize_kv_cache` with the number every rank agreed on (the minimum), then
`execute_model` once per step, in order; `kv_cache_spec` describes the cache to connectors;
`start_profile` / `stop_profile` bracket a torch.profiler window (sluice.worker.profiler).

At tensor_parallel_size N > 1 there are N workers, one per process, each given its TPGroup by
the process that made the group (sluice.executor.worker_proc): its model runner holds its shard
of the model and its cache its share of the KV heads; the block ids are the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sluice.config import EngineConfig
from sluice.core.kv_cache_groups import kv_cache_groups
from sluice.core.kv_connector import KVCacheSpec
from sluice.core.outputs import SchedulerOutput
from sluice.distributed.head_split import kv_heads_per_rank
from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.attention import attention_layers
from sluice.worker.kv_connector import KVConnectorWorker
from sluice.worker.model_runner import ModelRunner
from sluice.worker.profiler import ProfileSummary, StepProfiler
from sluice.worker.step_handle import StepHandle

# Builds this rank's connector half once its KV cache exists (the executor supplies it, so
# the worker does not depend on the connector implementations).
ConnectorFactory = Callable[[KVCacheSpec], KVConnectorWorker]


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0,
                 connector_factory: ConnectorFactory | None = None,
                 tp: TPGroup = SINGLE_RANK) -> None:
        """rank: this worker among the executor's; tp: its tensor-parallel group (the same
        rank, or SINGLE_RANK for a whole-model worker)."""
        self.config = config
        self.rank = rank
        self.tp = tp
        self.model_runner = ModelRunner(config.model_config, config.cache_config,
                                        config.scheduler_config, config.hf_config, tp,
                                        kv_cache_groups(config))
        self.connector_factory = connector_factory
        self.connector: KVConnectorWorker | None = None
        self.profiler = StepProfiler(rank)

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheSpec:
        """Build the connector, allocate `num_blocks` blocks per layer (where the connector
        places them, if it does), capture graphs, and give the cache to the connector; returns
        the cache's description."""
        runner = self.model_runner
        spec = self.kv_cache_spec()
        if self.connector_factory is not None:
            self.connector = self.connector_factory(spec)
        allocator = self.connector.kv_cache_allocator() if self.connector is not None else None
        runner.initialize_kv_cache(num_blocks, with_connector=self.connector is not None,
                                   allocator=allocator)
        if self.connector is not None:
            self.connector.register_kv_caches(runner.connector_kv_caches())
            runner.kv_connector = self.connector
        return spec

    def kv_cache_spec(self) -> KVCacheSpec:
        runner = self.model_runner
        hf_config = self.config.hf_config
        return KVCacheSpec(
            model=self.config.model_config.model,
            dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
            block_size=self.config.cache_config.block_size,
            num_kv_heads=kv_heads_per_rank(hf_config.num_key_value_heads, self.tp.size),
            head_dim=hf_config.head_dim,
            layer_names=tuple(attention_layers(runner.model)),
            tp_rank=self.tp.rank,
            tp_size=self.tp.size,
            max_tokens_per_step=self.config.scheduler_config.max_num_batched_tokens,
            model_num_kv_heads=hf_config.num_key_value_heads,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        self.profiler.count_step()
        return self.model_runner.launch(scheduler_output)

    def start_profile(self) -> None:
        self.profiler.start()

    def stop_profile(self) -> ProfileSummary:
        return self.profiler.stop()

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
            self.connector = None
        self.model_runner.shutdown()

    @property
    def device(self) -> torch.device:
        return self.model_runner.device
