"""EngineCore: one loop of schedule -> execute -> update, over requests already tokenized.

The model runs behind an executor (sluice/executor/): in this process, or in one worker process
per rank. A KV connector, when configured, has its scheduler half here and its worker half on
every rank; they meet only through the step messages.

Structured outputs: the grammars' matchers live here (sluice/structured_output/manager.py), and
each step's masks travel to the sampler in the step message. With async scheduling, a
constrained request's next mask needs the token still in flight: when one has, the step takes
the in-flight result before scheduling (that step loses the overlap; requests stay at one token
per step). Steps without constrained requests are untouched.

Speculative decoding: every step overlaps like any step: the workers propose the drafts on the
device after the tokens still in flight (n-gram: sluice/spec_decode/device_ngram.py; a draft
model or EAGLE head: its device pass after each step, sluice/spec_decode/model_proposer.py).
Without async scheduling steps with drafts, and every step of a model proposer, run
synchronously (their drafts are proposed on the host from the step's tokens).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

from sluice import stage_trace
from sluice.config import EngineConfig
from sluice.core.hybrid_kv_cache_manager import HybridKVCacheManager
from sluice.core.kv_cache_groups import kv_cache_groups
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.outputs import EngineCoreOutput, SchedulerOutput
from sluice.core.request import EngineCoreRequest, Request, RequestStatus
from sluice.core.scheduler import Scheduler
from sluice.executor.base import Executor, StepFuture
from sluice.executor.factory import create_executor
from sluice.structured_output.manager import StructuredOutputManager

# How long a step with nothing to run but grammars compiling sleeps on them.
_COMPILE_WAIT_S = 0.05


def freeing_window(config: EngineConfig) -> int | None:
    """The window behind which a one-group KV cache manager frees a request's blocks (see
    sluice/core/kv_cache_groups.py): the model's where every layer attends in it (Mistral,
    Phi-3), widened by n-gram drafts; None where every block is kept or the model's groups are
    split (Gemma 3: HybridKVCacheManager)."""
    groups = kv_cache_groups(config)
    return groups.windows[0] if groups.num_groups == 1 else None


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor if executor is not None else create_executor(config)
        try:
            self._initialize(config)
        except BaseException:
            self.executor.shutdown()
            raise
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.in_flight: tuple[SchedulerOutput, StepFuture] | None = None
        # Everything built so far (blocks, model, graphs) lives as long as the engine: keep it
        # out of the cyclic collector, whose full passes would otherwise walk every block.
        gc.collect()
        gc.freeze()

    def _initialize(self, config: EngineConfig) -> None:
        scheduler_config, cache_config = config.scheduler_config, config.cache_config
        num_blocks = self.executor.determine_num_blocks()
        # One request at max_model_len must fit on its own, or it could never be scheduled
        # (in every KV cache group: a windowed group of a split model holds its window and a
        # step's tokens at most).
        blocks_per_seq = kv_cache_groups(config).max_blocks_per_request(
            scheduler_config.max_model_len, cache_config.block_size,
            scheduler_config.max_num_batched_tokens)
        if blocks_per_seq > num_blocks - 1:
            raise ValueError(
                f"max_model_len ({scheduler_config.max_model_len}) needs {blocks_per_seq} KV "
                f"blocks but the cache has {num_blocks - 1}: lower max_model_len or give the "
                "KV cache more memory (num_gpu_blocks_override / gpu_memory_utilization)")
        kv_cache_spec = self.executor.initialize_kv_cache(num_blocks)
        groups = kv_cache_groups(config)
        manager_args = dict(
            num_blocks=num_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            # A connector reads every block hash when the step is scheduled.
            defer_caching=config.kv_transfer_config is None,
        )
        self.kv_cache_manager: KVCacheManager | HybridKVCacheManager = (
            KVCacheManager(**manager_args, sliding_window=groups.windows[0])
            if groups.num_groups == 1 else HybridKVCacheManager(groups, **manager_args))
        connector = None
        if config.kv_transfer_config is not None:
            from sluice.kv_transfer.factory import create_scheduler_connector

            connector = create_scheduler_connector(config.kv_transfer_config, kv_cache_spec)
        # Costs nothing until a constrained request comes (no thread, no tokenizer, no xgrammar).
        self.structured_output = StructuredOutputManager(config.model_config.tokenizer,
                                                         config.hf_config.vocab_size)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager, connector,
                                   config.kv_transfer_config, self.structured_output)

    def shutdown(self) -> None:
        """Give back the device memory (CUDA graphs, KV cache, weights) and stop the workers
        now. The engine's objects were frozen out of the cyclic collector at start-up, so
        dropping the last reference alone would not free them; unfreeze so the rest can be
        collected."""
        self.in_flight = None
        self.structured_output.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        self.executor.shutdown()
        gc.unfreeze()
        gc.collect()

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        if isinstance(request, EngineCoreRequest):
            request = Request.from_engine_core_request(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.in_flight is not None
                or self.scheduler.has_pending_kv_transfers())

    def step(self) -> list[EngineCoreOutput]:
        """One step. With async scheduling, launch the next step before taking the results
        of the one in flight, so scheduling and output handling overlap the device; outputs
        then trail by one step, and a request that stopped may have computed one token more
        (discarded)."""
        scheduler = self.scheduler
        outputs: list[EngineCoreOutput] = []
        if self.in_flight is not None and (
                (self.structured_output.requests and scheduler.has_constrained_token_in_flight())
                or scheduler.drafts_need_tokens_in_flight()):
            outputs = self._take_in_flight()
        launched = None
        if scheduler.has_unfinished_requests() or scheduler.has_pending_kv_transfers():
            scheduler_output = scheduler.schedule()
            if stage_trace.ON and not scheduler_output.is_empty:
                stage_trace.mark("sched", str(scheduler_output.total_num_scheduled_tokens))
            failed = scheduler.take_outputs_without_step()
            outputs += failed
            if scheduler.connector is not None:
                # Even a step of no tokens goes to the workers: they report transfers there.
                launched = (scheduler_output, self.executor.execute_model(scheduler_output))
            elif not scheduler_output.is_empty:
                launched = (scheduler_output, self.executor.execute_model(scheduler_output))
            elif scheduler_output.finished_req_ids:
                self.executor.execute_model(scheduler_output)  # only drops their state
            # The step's new full blocks into the prefix cache while the device runs it.
            scheduler.cache_scheduled_blocks()
            if scheduler_output.is_empty and self.in_flight is None and launched is None:
                if self.structured_output.has_pending_compiles():
                    self.structured_output.wait_for_compiles(_COMPILE_WAIT_S)
                elif not failed:
                    # Cannot happen while one max_model_len request fits the cache; never spin.
                    raise RuntimeError(f"scheduler made no progress with "
                                       f"{scheduler.get_num_unfinished_requests()} requests")
        if self.in_flight is not None:
            outputs += self._take_in_flight()
        if launched is not None:
            # A step of no tokens (a connector's poll) is taken at once: kept in flight, it
            # would keep the busy loop from ever waiting, and the loop would hold the GIL
            # from the connector's threads (sends and receives then wait for its switches).
            if (self.async_scheduling and not launched[0].is_empty
                    and not scheduler.runs_synchronously(launched[0])):
                self.in_flight = launched
                # Its connector report is known already (in-process workers): finished loads
                # hand out their first tokens now, not when the step's tokens are.
                report = launched[1].take_connector_output()
                if report is not None:
                    outputs += scheduler.update_connector_output(report)
            else:
                scheduler_output, future = launched
                result = future.result()
                if stage_trace.ON and not scheduler_output.is_empty:
                    stage_trace.mark("result", str(scheduler_output.total_num_scheduled_tokens))
                outputs += scheduler.update_from_output(scheduler_output, result)
        return outputs

    def _take_in_flight(self) -> list[EngineCoreOutput]:
        scheduler_output, future = self.in_flight
        self.in_flight = None
        result = future.result()
        if stage_trace.ON and not scheduler_output.is_empty:
            stage_trace.mark("result", str(scheduler_output.total_num_scheduled_tokens))
        return self.scheduler.update_from_output(scheduler_output, result)
