"""Where an engine step's time goes: host phases, time spent waiting on the device, GPU kernels.

    python -m sluice.bench.profile_steps [--num-requests 64] [--output JSON] [engine flags]

Runs (a scaled-down) nano-vllm workload through LLM.generate with every phase of
EngineCore.step and LLMEngine.step timed: schedule, launch (input preparation and queueing the
device work), result (blocking until the step's tokens are back: device time not hidden), update
(scheduler bookkeeping) and output processing. A torch.profiler window over a few steps lists
the top GPU kernels (those steps are included in the phase times). Prints per-phase totals and
per-step means; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from typing import Any


def add_parser(subparsers: Any) -> None:
    from sluice.entrypoints.cli import add_engine_args

    parser = subparsers.add_parser("profile", help="time the phases of engine steps")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--profile-steps", type=int, default=20,
                        help="steps from step 100 under torch.profiler (GPU kernels); 0 = none")
    parser.add_argument("--output", default=None)
    add_engine_args(parser)
    parser.set_defaults(func=main)


def _timed(phases: dict[str, float], name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start
    return wrapper


def main(ns: argparse.Namespace) -> int:
    import torch

    from sluice import SamplingParams
    from sluice.bench.offline_report import command_line, machine_info
    from sluice.bench.throughput import build_llm
    from sluice.bench.workloads import nano_vllm_workload
    from sluice.worker.step_handle import StepHandle

    llm, device, _ = build_llm(ns)
    workload = nano_vllm_workload(ns.num_requests, ns.max_input_len, ns.max_output_len)
    workload = workload.fold_token_ids(llm.llm_engine.hf_config.vocab_size)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m)
              for m in workload.max_tokens]
    llm.generate(prompts[:4], [SamplingParams(max_tokens=8)] * 4, use_tqdm=False)  # warm-up

    engine = llm.llm_engine
    core = engine.engine_core
    phases: dict[str, float] = defaultdict(float)
    core.scheduler.schedule = _timed(phases, "schedule", core.scheduler.schedule)
    core.model_runner.launch = _timed(phases, "launch", core.model_runner.launch)
    core.scheduler.update_from_output = _timed(phases, "update", core.scheduler.update_from_output)
    engine.output_processor.process_outputs = _timed(
        phases, "output_processing", engine.output_processor.process_outputs)
    original_result = StepHandle.result
    StepHandle.result = _timed(phases, "result_wait", original_result)  # type: ignore[method-assign]
    steps = [0]
    core_step = core.step

    def counting_step() -> Any:
        steps[0] += 1
        return core_step()

    core.step = _timed(phases, "engine_step_total", counting_step)
    from sluice.engine.processors import RequestOutputKind

    kernels: list[dict[str, Any]] = []
    host_ops: list[dict[str, Any]] = []
    profiler = None
    window = range(100, 100 + ns.profile_steps) if device.type == "cuda" else range(0)
    try:
        start = time.perf_counter()
        for prompt, p in zip(prompts, params):
            engine.add_request(None, prompt, p, RequestOutputKind.FINAL_ONLY)
        while engine.has_unfinished_requests():
            if steps[0] == window.start and len(window):
                from torch.profiler import ProfilerActivity, profile

                profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                profiler.__enter__()
            engine.step()
            if profiler is not None and steps[0] == window.stop:
                torch.cuda.synchronize()
                profiler.__exit__(None, None, None)
                events = sorted(profiler.key_averages(), key=lambda e: -e.device_time_total)
                kernels = [{"name": e.key[:90], "calls": e.count,
                            "device_ms_per_step": round(e.device_time_total / 1000
                                                        / len(window), 3)}
                           for e in events[:15]]
                # Host time by op: a CUDA runtime call that blocks (a sync, a pageable copy)
                # shows up here.
                events = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
                host_ops = [{"name": e.key[:90], "calls": e.count,
                             "host_ms_per_step": round(e.self_cpu_time_total / 1000
                                                       / len(window), 3)}
                            for e in events[:20]]
                profiler = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        StepHandle.result = original_result  # type: ignore[method-assign]

    output_tokens = sum(workload.max_tokens)
    result = {
        "command": command_line(None), **machine_info(device),
        "num_requests": ns.num_requests, "output_tokens": output_tokens, "steps": steps[0],
        "wall_s": round(wall, 3), "output_tok_s": round(output_tokens / wall, 1),
        "phases_s": {k: round(v, 3) for k, v in sorted(phases.items())},
        "phases_ms_per_step": {k: round(1000 * v / max(steps[0], 1), 3)
                               for k, v in sorted(phases.items())},
        "top_gpu_kernels_steps_100_on": kernels,
        "top_host_ops_steps_100_on": host_ops,
    }
    print(json.dumps(result, indent=1))
    if ns.output:
        with open(ns.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0
