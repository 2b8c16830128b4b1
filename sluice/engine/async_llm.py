"""AsyncLLM: the asyncio front end of an engine core running in its own process.

Input processing (tokenize, validate, `n > 1` fan-out) and output processing (detokenize, stop
strings, logprobs) run here; the engine core process only schedules and runs the model. Requests
go out on a ZMQ PUSH socket; one output-handler task per event loop reads the core's outputs
from a PULL socket (every frame waiting, at each wakeup), turns them into RequestOutputs and
puts them into one stream per request, where the outputs a slow caller has not taken yet merge
into one (output_stream.py: a DELTA caller then gets several steps' tokens at once). The
handler also keeps the latest SchedulerStats, feeds request timings to `self.stats` (listeners:
logs, Prometheus), and watches the process: when the core dies, every generate in flight raises
EngineDeadError within about a second, and so does every later call.

    llm = AsyncLLM.from_engine_args(EngineArgs(model="path/to/model"))
    async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
        print(out.outputs[0].text, end="")    # DELTA: the new text of each step
    llm.shutdown()
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any

import zmq
import zmq.asyncio

from sluice import stage_trace
from sluice.channel import Encoder, WireError
from sluice.config import EngineConfig
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.core_client import CoreAttachment, attach_engine_core, launch_engine_core
from sluice.engine.output_stream import EngineDiedInFlight, RequestOutputStream
from sluice.engine.processors import (
    InputProcessor,
    OutputProcessor,
    PromptType,
    RequestOutputKind,
    load_eos_token_ids,
)
from sluice.engine.stats import (
    IterationStats,
    RequestStatsTracker,
    SchedulerStats,
    StatsListener,
    StatsLogger,
)
from sluice.engine.wire import (
    UTILITY_NAMES,
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    EngineDead,
    FinishRequests,
    ResponseDecoder,
    UtilityReply,
    UtilityRequest,
)
from sluice.errors import EngineDeadError
from sluice.model.tokenizer import load_tokenizer
from sluice.outputs import RequestOutput
from sluice.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]

logger = logging.getLogger("sluice")

# How often (s) the output handler, when no output came, checks that the core is alive.
_LIVENESS_CHECK_S = 0.5
# How often (s) at most a health check asks the OS whether the core process still runs.
_PROCESS_POLL_S = 0.05
# Engine-core frames (steps) the output handler takes in one go before the callers run.
_MAX_FRAMES_PER_WAKEUP = 64


def core_process_args(engine_args: EngineArgs, config: EngineConfig) -> dict[str, Any]:
    """The engine arguments as the JSON-able dict the engine-core process rebuilds its configs
    from: the model folder as resolved here (the built-in model is fetched, and a .gguf file's
    folder made, once, by this process), the speculative and KV-transfer configs as the
    validated dicts of their fields, however the user gave them (dict, JSON string, config
    object, shorthand; a bootstrap port 0 made a free port here, once)."""
    core_args = dataclasses.asdict(engine_args)
    spec = config.scheduler_config.speculative_config
    kv_transfer = config.kv_transfer_config
    core_args.update(model=config.model_config.model, tokenizer=config.model_config.tokenizer,
                     hf_config_path=None,  # a .gguf model's folder holds the config given
                     speculative_config=None if spec is None else dataclasses.asdict(spec),
                     kv_transfer_config=None if kv_transfer is None else kv_transfer.to_dict(),
                     kv_offloading_size=None, disaggregation_mode=None)
    return core_args


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs, *, ready_timeout_s: float = 600.0,
                 log_stats: bool = True, log_stats_interval_s: float = 5.0,
                 attach: CoreAttachment | None = None) -> None:
        """Start the engine core and wait for it. `ready_timeout_s`: how long the core may
        take to load the model; `log_stats`: log a throughput line every
        `log_stats_interval_s` seconds while busy; `attach`: instead of starting a core, be
        one of the front ends of a core another process started (core_client.
        launch_shared_engine_core, with the same engine arguments). ValueError for bad engine
        arguments."""
        config = engine_args.create_engine_config()
        model_config, scheduler_config = config.model_config, config.scheduler_config
        hf_config, cache_config = config.hf_config, config.cache_config
        self.config = config
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.hf_config = hf_config

        if attach is None:
            core_args = core_process_args(engine_args, config)
            self._core = launch_engine_core(core_args, logger.getEffectiveLevel())
            self.client = 0
        else:
            self._core = attach_engine_core(attach)
            self.client = attach.client
        self._finalizer = weakref.finalize(self, self._core.release)
        self._process = self._core.process
        self._input_socket = self._core.input_socket
        self.input_address = self._core.input_address
        self.output_address = self._core.output_address

        self._encoder = Encoder()
        self._decoder = ResponseDecoder()
        self._streams: dict[str, RequestOutputStream] = {}
        self._utility_calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._handler_task: asyncio.Task[None] | None = None
        self._handler_loop: asyncio.AbstractEventLoop | None = None
        self._dead_error: str | None = None
        self._last_process_poll = -float("inf")
        self.latest_scheduler_stats: SchedulerStats | None = None
        self.stats = RequestStatsTracker()
        if log_stats:
            self.stats.add_listener(StatsLogger(log_stats_interval_s))
        try:
            # The tokenizer loads here while the core process starts.
            self.tokenizer = load_tokenizer(model_config.tokenizer)
            eos_ids = load_eos_token_ids(model_config.model, hf_config, self.tokenizer)
            self.input_processor = InputProcessor(self.tokenizer, eos_ids,
                                                  scheduler_config.max_model_len,
                                                  hf_config.vocab_size)
            self.output_processor = OutputProcessor(self.tokenizer)
            ready = self._core.wait_for_ready(ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = ready.num_blocks
        self.max_model_len = ready.max_model_len
        self.engine_core_pid = ready.pid
        self.worker_pids = ready.worker_pids

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Start the engine core process and wait until it is ready (see __init__ for the
        keyword arguments). Raises EngineDeadError if the core fails to start."""
        return cls(engine_args, **kwargs)

    # ---- state ---------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self.is_healthy()

    def is_healthy(self) -> bool:
        return self._check_alive() is None

    @property
    def dead_error(self) -> str | None:
        """Why the engine is dead (None while it runs)."""
        return self._check_alive()

    def add_stats_listener(self, listener: StatsListener) -> None:
        self.stats.add_listener(listener)

    def _check_alive(self) -> str | None:
        # Every request asks (a waitpid each): under a burst of requests, ask the OS at most
        # every _PROCESS_POLL_S; a death is noticed that much later at most.
        if self._dead_error is not None:
            return self._dead_error
        now = time.monotonic()
        if now - self._last_process_poll < _PROCESS_POLL_S:
            return None
        self._last_process_poll = now
        if not self._process.is_alive():
            status = self._process.exitcode
            self._dead_error = (f"engine core process {self._process.pid} exited"
                                + ("" if status is None else f" with status {status}"))
        return self._dead_error

    def _raise_if_dead(self) -> None:
        error = self._check_alive()
        if error is not None:
            raise EngineDeadError(f"the engine is dead: {error}")

    # ---- requests ------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the last has `finished=True`. Bad input raises
        ValueError before anything reaches the engine core. Stopping the iteration (break,
        cancellation, a closed HTTP connection) aborts the request in the core at once.
        `kv_transfer_params`: for the engine's KV connector (vLLM's field)."""
        self._raise_if_dead()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = sampling_params.clone()  # input processing fills in the stop token ids
        arrival_time = time.time()
        prompt_text, children = self.input_processor.process(request_id, prompt, params,
                                                             arrival_time, kv_transfer_params)
        self._ensure_output_handler()
        stream = RequestOutputStream(output_kind)
        self._streams[request_id] = stream
        self.output_processor.add_request(request_id, prompt_text, children, params,
                                          output_kind, arrival_time)
        self.stats.add_request(request_id, arrival_time, len(children[0].prompt_token_ids),
                               params.max_tokens)
        finished = False
        try:
            for child in children:
                self._send(AddRequest(request=child, client=self.client))
            while not finished:
                try:
                    output = await stream.get()
                except EngineDiedInFlight:
                    raise EngineDeadError(f"the engine died during request {request_id!r}: "
                                          f"{self._dead_error}") from None
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort_now([request_id], notify=False)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """End requests. A generate still iterating gets a last output whose unfinished
        samples have finish_reason "abort". Unknown or finished ids are ignored."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._abort_now(request_ids, notify=True)

    def _abort_now(self, request_ids: list[str], notify: bool) -> None:
        if notify:
            outputs, children = self.output_processor.abort_requests_with_outputs(request_ids)
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
        else:
            children = self.output_processor.abort_requests(request_ids)
        iteration = IterationStats(timestamp=time.time())
        for request_id in request_ids:
            self.stats.finish_request(iteration, request_id, "abort")
        if iteration.finished_requests:
            self.stats.record(iteration, None)
        if children and self._dead_error is None:
            try:
                self._send(AbortRequests(request_ids=children))
            except EngineDeadError:
                pass  # nothing left to abort

    # ---- utility calls -------------------------------------------------------------------

    async def call_utility(self, name: str) -> Any:
        """Run a utility in the engine core between two steps and return its result:
        "stats" (SchedulerStats), "reset_prefix_cache" (bool), "check_integrity" (True).
        A failed call raises RuntimeError with the core's message."""
        if name not in UTILITY_NAMES:
            raise ValueError(f"unknown utility {name!r}; allowed: {list(UTILITY_NAMES)}")
        self._raise_if_dead()
        self._ensure_output_handler()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        try:
            self._send(UtilityRequest(call_id=call_id, name=name, client=self.client))
            return await future
        finally:
            self._utility_calls.pop(call_id, None)

    async def get_stats(self) -> SchedulerStats:
        """The scheduler and KV cache now (asked of the core, not the last step's copy)."""
        return await self.call_utility("stats")

    async def reset_prefix_cache(self) -> bool:
        return await self.call_utility("reset_prefix_cache")

    async def check_integrity(self) -> None:
        await self.call_utility("check_integrity")

    # ---- plumbing ------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        try:
            self._input_socket.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except (zmq.Again, zmq.ZMQError) as exc:
            # PUSH refuses only when no core is connected any more.
            raise EngineDeadError(f"cannot reach the engine core: {exc}") from None

    def _ensure_output_handler(self) -> None:
        """Start the output handler in the running loop (again, if an earlier loop ended)."""
        loop = asyncio.get_running_loop()
        task = self._handler_task
        if task is not None and not task.done():
            if self._handler_loop is loop:
                return
            assert self._handler_loop is not None
            if self._handler_loop.is_running():
                raise RuntimeError("AsyncLLM is in use by another running event loop")
        socket = zmq.asyncio.Socket.from_socket(self._core.output_socket)
        self._handler_task = loop.create_task(self._run_output_handler(socket),
                                              name="sluice-output-handler")
        self._handler_loop = loop

    async def _run_output_handler(self, socket: zmq.asyncio.Socket) -> None:
        frames = self._core.output_socket  # the same socket, read without awaiting
        try:
            while self._dead_error is None:
                if not await socket.poll(int(_LIVENESS_CHECK_S * 1000)):
                    self._check_alive()
                    continue
                # Every step waiting, before any caller runs: when the callers are behind,
                # their streams merge several steps into one output (output_stream.py).
                for _ in range(_MAX_FRAMES_PER_WAKEUP):
                    try:
                        frame = frames.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        message = self._decoder.decode(frame.buffer)
                    except WireError as exc:
                        logger.error("front end dropped a frame from the engine core: %s", exc)
                        continue
                    self._handle(message)
                    if self._dead_error is not None:
                        break
            # Dead, whoever noticed first (this task, is_healthy(), shutdown()).
            self._fail_in_flight()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self._finalizer.alive:
                return  # shut down under the handler's feet
            # A bug in output processing: the request states can no longer be trusted.
            logger.exception("the output handler failed")
            self._dead_error = f"output handler failed: {type(exc).__name__}: {exc}"
            self._fail_in_flight()
            self._finalizer()

    def _handle(self, message: object) -> None:
        if isinstance(message, EngineCoreOutputs):
            self._process_outputs(message)
        elif isinstance(message, UtilityReply):
            future = self._utility_calls.get(message.call_id)
            if future is not None and not future.done():
                if message.error is not None:
                    future.set_exception(RuntimeError(message.error))
                else:
                    future.set_result(message.result)
        elif isinstance(message, EngineDead):
            logger.error("the engine core died: %s\n%s", message.error, message.traceback)
            self._dead_error = message.error
        else:
            logger.warning("front end ignored an unexpected %s", type(message).__name__)

    def _process_outputs(self, message: EngineCoreOutputs) -> None:
        if stage_trace.ON:
            stage_trace.mark("fe_out", str(sum(len(o.new_token_ids) for o in message.outputs)))
        if message.scheduler_stats is not None:
            self.latest_scheduler_stats = message.scheduler_stats
        core_outputs = message.outputs
        iteration = IterationStats(timestamp=time.time())
        for out in core_outputs:
            parent = self.output_processor.child_to_parent.get(out.req_id)
            if parent is not None:
                self.stats.observe_tokens(iteration, parent[0], len(out.new_token_ids),
                                          out.first_scheduled_time, out.num_cached_tokens)
        request_outputs, stopped_children = self.output_processor.process_outputs(core_outputs)
        if stopped_children:
            self._send(FinishRequests(request_ids=stopped_children))
        for output in request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
            if output.finished:
                self.stats.finish_request(iteration, output.request_id,
                                          output.outputs[0].finish_reason or "abort")
        self.stats.record(iteration, message.scheduler_stats)

    def _fail_in_flight(self) -> None:
        for stream in self._streams.values():
            stream.put_dead()
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine is dead: {self._dead_error}"))

    def shutdown(self) -> None:
        """Stop the engine core process and free the sockets. Idempotent; requests in flight
        raise EngineDeadError."""
        if self._dead_error is None:
            self._dead_error = "the engine was shut down"
        self._fail_in_flight()
        task, loop = self._handler_task, self._handler_loop
        if task is not None and not task.done() and loop is not None and not loop.is_closed():
            if loop.is_running():
                loop.call_soon_threadsafe(task.cancel)
            else:
                task.cancel()
        self._finalizer()
