"""Where an engine step's time goes: host phases, time spent waiting on the device, GPU kernels.

    python -m sluice.bench.profile_steps [--num-requests 64] [--output JSON] [engine flags]

Runs (a scaled-down) nano-vllm workload through LLM.generate with every phase of
EngineCore.step and LLMEngine.step timed: schedule, launch (input preparation and queueing the
device work), result (blocking until the step's tokens are back: device time not hidden), update
(scheduler bookkeeping) and output processing. On a GPU, CUDA events around each launch give a
device timeline: per kind of step (prefill/mixed, or decode by batch size) the device time and
the time the device sat idle waiting for the host before it. torch.profiler windows of a few
steps (`--profile-at`, e.g. at batch ~256, ~128 and ~16) list the top GPU kernels; those steps
are included in the phase times and the timeline, so take the timeline from a run without them
(`--profile-steps 0`). Prints per-phase totals and per-step means; writes JSON.

`--fixed-lengths` gives every request a prompt of max-input-len random tokens and max-output-len
greedy tokens (the shapes of `sluice bench latency`); `--host-profile N` runs under cProfile and
lists the N functions of the most host time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time
from collections import defaultdict
from typing import Any


def add_parser(subparsers: Any) -> None:
    from sluice.engine.flags import add_engine_args

    parser = subparsers.add_parser("profile", help="time the phases of engine steps")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--fixed-lengths", action="store_true",
                        help="every prompt max-input-len tokens, every output max-output-len "
                             "(greedy): the shapes of `sluice bench latency`")
    parser.add_argument("--profile-steps", type=int, default=20,
                        help="steps per window under torch.profiler (GPU kernels); 0 = none")
    parser.add_argument("--profile-at", default="100",
                        help="comma-separated first steps of the profiler windows")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="run under cProfile and report the N functions of the most host "
                             "time (own and cumulative, ms per step); 0 = no")
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
    from sluice.bench.record import make_record, write_record
    from sluice.bench.throughput import build_llm
    from sluice.bench.workloads import OfflineWorkload, nano_vllm_workload, random_prompts
    from sluice.worker.cuda_graphs import DecodeGraphs
    from sluice.worker.step_handle import StepHandle

    llm, device, _ = build_llm(ns)
    vocab_size = llm.llm_engine.hf_config.vocab_size
    if ns.fixed_lengths:
        rng = random.Random(ns.seed)
        token_ids = random_prompts(ns.num_requests + 4, ns.max_input_len, vocab_size, rng)
        workload = OfflineWorkload(token_ids[4:], [ns.max_output_len] * ns.num_requests)
        temperature = 0.0
        warm_up = [{"prompt_token_ids": p} for p in token_ids[:4]]  # no prefix shared
    else:
        workload = nano_vllm_workload(ns.num_requests, ns.max_input_len, ns.max_output_len)
        workload = workload.fold_token_ids(vocab_size)
        temperature = 0.6
        warm_up = None
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m)
              for m in workload.max_tokens]
    warm_up = warm_up or prompts[:4]
    llm.generate(warm_up, [SamplingParams(max_tokens=8)] * len(warm_up), use_tqdm=False)

    engine = llm.llm_engine
    core = engine.engine_core
    phases: dict[str, float] = defaultdict(float)
    core.scheduler.schedule = _timed(phases, "schedule", core.scheduler.schedule)
    # The model runner is in this process with the uni executor; with worker processes (mp,
    # tensor parallelism) only the engine's phases and the profiler windows are measured.
    runner = getattr(core.executor, "model_runner", None)
    if runner is not None:
        runner.launch = _timed(phases, "launch", runner.launch)
        # Parts of launch: the graph replay's host call, and sampling (logits on).
        runner.sample = _timed(phases, "launch.sample", runner.sample)
        runner.input_builder.prepare = _timed(phases, "launch.prepare",
                                              runner.input_builder.prepare)
    original_replay = DecodeGraphs.replay
    DecodeGraphs.replay = _timed(phases, "launch.graph_replay", original_replay)
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

    # Device timeline: an event once a launch has copied its inputs (the model's work is queued
    # next) and one after its sampling.
    timeline: list[tuple[Any, Any, int, int]] = []  # (start, end, tokens, requests)
    builder = runner.input_builder if runner is not None else None
    original_launch = runner.launch if runner is not None else None
    original_prepare = builder.prepare if builder is not None else None
    if device.type == "cuda" and runner is not None:
        begun: list[Any] = []

        def timed_prepare(*args: Any) -> Any:
            step = original_prepare(*args)
            begun.append(torch.cuda.Event(enable_timing=True))
            begun[-1].record()
            return step

        def timed_launch(scheduler_output: Any) -> Any:
            begun.clear()
            handle = original_launch(scheduler_output)
            if begun:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                timeline.append((begun[0], end, scheduler_output.total_num_scheduled_tokens,
                                 len(scheduler_output.num_scheduled_tokens)))
            return handle

        runner.launch, builder.prepare = timed_launch, timed_prepare

    compiles = _watch_jit_compiles() if device.type == "cuda" else None
    windows: list[dict[str, Any]] = []
    starts = ([int(x) for x in ns.profile_at.split(",") if x.strip()]
              if ns.profile_steps > 0 else [])
    profiling = False
    window_start = 0
    host_profiler = cProfile.Profile() if ns.host_profile > 0 else None
    try:
        start = time.perf_counter()
        if host_profiler is not None:
            host_profiler.enable()
        for prompt, p in zip(prompts, params):
            engine.add_request(None, prompt, p, RequestOutputKind.FINAL_ONLY)
        while engine.has_unfinished_requests():
            if steps[0] in starts and not profiling:
                llm.start_profile()  # on every rank: tensor-parallel workers' kernels too
                profiling = True
                window_start = steps[0]
                batch = core.scheduler.get_num_unfinished_requests()
            engine.step()
            if profiling and steps[0] == window_start + ns.profile_steps:
                profiling = False
                windows.append(_profiler_window(llm.stop_profile(), window_start, batch))
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        if host_profiler is not None:
            host_profiler.disable()
        StepHandle.result = original_result  # type: ignore[method-assign]
        if runner is not None:
            runner.launch, builder.prepare = original_launch, original_prepare
        if compiles is not None:
            compiles.stop()

    output_tokens = sum(workload.max_tokens)
    result = {
        "num_requests": ns.num_requests, "output_tokens": output_tokens, "steps": steps[0],
        "wall_s": round(wall, 3), "output_tok_s": round(output_tokens / wall, 1),
        "phases_s": {k: round(v, 3) for k, v in sorted(phases.items())},
        "phases_ms_per_step": {k: round(1000 * v / max(steps[0], 1), 3)
                               for k, v in sorted(phases.items())},
        "timeline": _summarize_timeline(timeline) if timeline else None,
        "profiler_windows": windows,
        "host_functions": (_host_functions(host_profiler, ns.host_profile, steps[0])
                           if host_profiler is not None else None),
        # Triton kernels compiled (or loaded from the disk cache) during the run: each one a
        # variant the warm-up did not reach. Clear ~/.triton/cache to see compile times.
        "jit_compiles_during_run": compiles.records if compiles is not None else None,
    }
    record = make_record("profile", result, device=device,
                         command=getattr(ns, "sluice_argv", None))
    print(json.dumps(record, indent=1))
    if ns.output:
        write_record(ns.output, record)
    return 0


def _host_functions(profiler: cProfile.Profile, top: int, steps: int) -> dict[str, Any]:
    """The `top` functions by own host time and by cumulative time, in ms per step (cProfile's
    overhead included: compare them with each other, not with the phase times)."""
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, calls, own, cum, callers)
    rows = [{"function": f"{'/'.join(path.split('/')[-2:])}:{line}({name})",
             "calls": calls, "own_ms_per_step": round(1000 * own / max(steps, 1), 4),
             "cum_ms_per_step": round(1000 * cum / max(steps, 1), 4)}
            for (path, line, name), (_, calls, own, cum, _) in stats.items()]
    return {
        "by_own_time": sorted(rows, key=lambda r: -r["own_ms_per_step"])[:top],
        "by_cumulative_time": sorted(rows, key=lambda r: -r["cum_ms_per_step"])[:top],
    }


def _profiler_window(summaries: list[Any], first_step: int, batch: int) -> dict[str, Any]:
    """Top GPU kernels and host ops of a window of steps, per step, for each rank (rank 0's
    at the top level); all-reduce: the device time per step of NCCL's all-reduce kernels."""

    def per_step(summary: Any) -> dict[str, Any]:
        steps = max(summary.steps, 1)
        return {
            "steps": summary.steps,
            "device_ms_per_step": round(summary.device_ms / steps, 3),
            "all_reduce_ms_per_step": round(summary.per_step("AllReduce"), 3),
            "top_gpu_kernels": [{"name": k.name[:90], "calls": k.calls,
                                 "device_ms_per_step": round(k.device_ms / steps, 3)}
                                for k in summary.kernels[:25]],
            # A CUDA runtime call that blocks (a sync, a pageable copy) shows up here.
            "top_host_ops": [{"name": h.name[:90], "calls": h.calls,
                              "host_ms_per_step": round(h.host_ms / steps, 3)}
                             for h in summary.host_ops],
        }

    ranks = [per_step(summary) for summary in summaries]
    window = {"first_step": first_step, "unfinished_requests": batch, **ranks[0]}
    if len(ranks) > 1:
        window["ranks"] = ranks
    return window


_DECODE_BUCKETS = ((193, 1 << 30), (129, 192), (65, 128), (33, 64), (9, 32), (1, 8))


def _summarize_timeline(timeline: list[tuple[Any, Any, int, int]]) -> dict[str, Any]:
    """Device time and idle time (the gap since the previous step's work ended) per kind of
    step: steps with prompt tokens, and decode steps by batch size."""
    first = timeline[0][0]
    rows = []
    for begin, end, tokens, reqs in timeline:
        rows.append((first.elapsed_time(begin), first.elapsed_time(end), tokens, reqs))
    kinds: dict[str, dict[str, float]] = {}

    def add(kind: str, busy: float, idle: float) -> None:
        k = kinds.setdefault(kind, {"steps": 0, "device_ms": 0.0, "idle_ms": 0.0})
        k["steps"] += 1
        k["device_ms"] += busy
        k["idle_ms"] += idle

    previous_end = rows[0][0]
    for begin, end, tokens, reqs in rows:
        idle = max(0.0, begin - previous_end)
        busy = end - max(begin, previous_end)
        previous_end = max(end, previous_end)
        if tokens > reqs:
            kind = "prefill_or_mixed"
        else:
            lo, hi = next(b for b in _DECODE_BUCKETS if b[0] <= reqs <= b[1])
            kind = f"decode_{lo}+" if hi == 1 << 30 else f"decode_{lo}-{hi}"
        add(kind, busy, idle)
    out = {}
    for kind, k in kinds.items():
        n = k["steps"]
        out[kind] = {"steps": n, "device_s": round(k["device_ms"] / 1000, 3),
                     "idle_s": round(k["idle_ms"] / 1000, 3),
                     "device_ms_per_step": round(k["device_ms"] / n, 3),
                     "idle_ms_per_step": round(k["idle_ms"] / n, 3)}
    total_busy = sum(k["device_ms"] for k in kinds.values()) / 1000
    total_idle = sum(k["idle_ms"] for k in kinds.values()) / 1000
    return {"span_s": round((rows[-1][1] - rows[0][0]) / 1000, 3),
            "device_s": round(total_busy, 3), "idle_s": round(total_idle, 3), "kinds": out}


class _JitWatch:
    """Triton's JIT hooks: each kernel variant built while installed, with the seconds it took."""

    def __init__(self) -> None:
        from triton import knobs

        self.knobs = knobs
        self.records: list[dict[str, Any]] = []
        self._started: dict[str, float] = {}
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, **kwargs: Any) -> bool:
        self._started[kwargs["repr"]] = time.perf_counter()
        return False

    def _after(self, **kwargs: Any) -> bool:
        start = self._started.pop(kwargs["repr"], time.perf_counter())
        self.records.append({"kernel": kwargs["repr"][:300],
                             "seconds": round(time.perf_counter() - start, 3)})
        return False

    def stop(self) -> None:
        self.knobs.runtime.jit_cache_hook = None
        self.knobs.runtime.jit_post_compile_hook = None


def _watch_jit_compiles() -> _JitWatch | None:
    try:
        return _JitWatch()
    except (ImportError, AttributeError):  # a Triton without these hooks
        return None
