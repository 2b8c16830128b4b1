"""A synthetic engine core: the real wire protocol of sluice/engine/core_proc.py, no model.

It admits up to `max_num_seqs` requests and, every `step_ms`, gives each running request one
token (a fixed pseudo-random id in [3, 600)) until its max_tokens, as an engine's decode steps
do, so the front end (AsyncLLM, the OpenAI server) can be loaded at GPU rates on any machine:
`benchmarks/tools/frontend_capacity.py` measures how many tokens per second the server streams
and what it costs per token. It answers the utility calls a server makes (stats, check_integrity,
reset_prefix_cache) and exits with its parent. Not an engine: no KV cache, no sampling; for
measuring the front end only.

    python -m sluice.testing.synthetic_core STARTUP_JSON   # as launch_engine_core spawns it
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import deque
from typing import Any

import zmq

from sluice.channel import Encoder
from sluice.core.outputs import EngineCoreOutput
from sluice.engine.stats import SchedulerStats
from sluice.engine.wire import (
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    FinishRequests,
    Ready,
    RequestDecoder,
    UtilityReply,
    UtilityRequest,
)
from sluice.process_utils import parent_alive

STEP_MS_ENV = "SLUICE_SYNTHETIC_STEP_MS"
MAX_SEQS_ENV = "SLUICE_SYNTHETIC_MAX_SEQS"


def run(input_address: str, output_address: str, parent_pid: int, step_s: float,
        max_num_seqs: int) -> None:
    context = zmq.Context()
    requests_in, outputs_out = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    requests_in.connect(input_address)
    outputs_out.connect(output_address)
    encoder, decoder = Encoder(), RequestDecoder()
    outputs_out.send(encoder.encode(Ready(num_blocks=1 << 20, block_size=16,
                                          max_model_len=1 << 20, pid=os.getpid(),
                                          worker_pids=[])))
    running: dict[str, list[int]] = {}  # req_id -> [tokens left]
    waiting: deque[tuple[str, int]] = deque()
    rng = random.Random(0)
    next_step = time.perf_counter()
    while parent_alive(parent_pid):
        if requests_in.poll(0 if running or waiting else 500):
            while True:
                try:
                    message = decoder.decode(requests_in.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(message, AddRequest):
                    waiting.append((message.request.request_id, message.request.max_tokens))
                elif isinstance(message, (AbortRequests, FinishRequests)):
                    for req_id in message.request_ids:
                        running.pop(req_id, None)
                elif isinstance(message, UtilityRequest):
                    result: Any = SchedulerStats() if message.name == "stats" else True
                    outputs_out.send(encoder.encode(UtilityReply(call_id=message.call_id,
                                                                 result=result)))
        if not (running or waiting):
            continue
        now = time.perf_counter()
        if now < next_step:
            time.sleep(min(next_step - now, 0.001))
            continue
        next_step = max(next_step + step_s, now)
        while waiting and len(running) < max_num_seqs:
            req_id, max_tokens = waiting.popleft()
            running[req_id] = [max_tokens]
        outputs = []
        for req_id, left in list(running.items()):
            left[0] -= 1
            done = left[0] <= 0
            outputs.append(EngineCoreOutput(req_id=req_id, new_token_ids=[rng.randrange(3, 600)],
                                            finish_reason="length" if done else None))
            if done:
                del running[req_id]
        outputs_out.send(encoder.encode(EngineCoreOutputs(
            outputs=outputs, scheduler_stats=SchedulerStats(num_running=len(running)),
            timestamp=time.time())))
    requests_in.close(linger=0)
    outputs_out.close(linger=0)
    context.term()


if __name__ == "__main__":
    startup = json.loads(sys.argv[1])
    # The engine core's startup message (sluice.engine.core_client): one front end's sockets.
    run(startup["input_addresses"][0], startup["output_addresses"][0], startup["parent_pid"],
        float(os.environ.get(STEP_MS_ENV, "5")) / 1000,
        int(os.environ.get(MAX_SEQS_ENV, "256")))
