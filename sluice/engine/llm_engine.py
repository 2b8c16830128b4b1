"""The synchronous engine: input processing, the engine core in-process, output processing."""

from __future__ import annotations

import itertools
import time
from typing import Any

from sluice.core.request import RequestStatus
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.core import EngineCore
from sluice.engine.processors import (
    InputProcessor,
    OutputProcessor,
    PromptType,
    RequestOutputKind,
    load_eos_token_ids,
)
from sluice.model.tokenizer import load_tokenizer
from sluice.outputs import RequestOutput
from sluice.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        config = engine_args.create_engine_config()
        model_config, scheduler_config = config.model_config, config.scheduler_config
        hf_config, cache_config = config.hf_config, config.cache_config
        self.config = config
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.hf_config = hf_config
        self.tokenizer = load_tokenizer(model_config.tokenizer)
        eos_ids = load_eos_token_ids(model_config.model, hf_config, self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, eos_ids,
                                              scheduler_config.max_model_len,
                                              hf_config.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config)
        self._request_counter = itertools.count()

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    arrival_time: float | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> str:
        if request_id is None:
            request_id = str(next(self._request_counter))
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival = time.time() if arrival_time is None else arrival_time
        text, children = self.input_processor.process(request_id, prompt, params, arrival,
                                                      kv_transfer_params)
        self.output_processor.add_request(request_id, text, children, params, output_kind,
                                          arrival)
        for child in children:
            self.engine_core.add_request(child)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        children = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(children)

    def shutdown(self) -> None:
        """Free the engine's device memory now; the engine cannot be used afterwards."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def drain_kv_transfers(self) -> None:
        """Step until no KV connector transfer holds blocks (delayed frees, aborted loads);
        each connector bounds its transfers (a save's copy, a send's lease)."""
        core = self.engine_core
        while core.scheduler.has_pending_kv_transfers() or core.in_flight is not None:
            core.step()
            if core.scheduler.has_pending_kv_transfers():
                time.sleep(0.0005)  # transfers progress on their own: do not spin

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    # For tests and metrics.
    @property
    def kv_cache_manager(self) -> Any:
        return self.engine_core.kv_cache_manager

    @property
    def scheduler(self) -> Any:
        return self.engine_core.scheduler
