"""`sluice bench throughput`: nano-vllm's offline workload through `LLM.generate`.

One warm-up generate of a few short requests, then one timed generate of the whole workload
with `SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m)` per request. Reported
against the roofline of the same workload and model on a GPU spec, and, with `--hf-baseline`,
against transformers' continuous batching measured in the same run on the same device.

`--repeat N` times the workload N more times in the same process, each run after
`reset_prefix_cache()`, so each computes every prompt as the first did; `--repeat-cached M`
then times it M more times with the prompts the run before left in the prefix cache, as a
second generate of the same prompts in one process does (`../shared/peer/bench_peer.py`): it
skips their prefill, which is why such a run beats the first. The headline figure is the first
run's.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from typing import Any

from sluice.bench.workloads import (
    NANO_VLLM_MAX_INPUT_LEN,
    NANO_VLLM_MAX_OUTPUT_LEN,
    NANO_VLLM_NUM_REQUESTS,
)

_WARMUP_REQUESTS, _WARMUP_PROMPT_LEN, _WARMUP_MAX_TOKENS = 4, 32, 8


def add_parser(bench_sub: Any) -> None:
    from sluice.bench.roofline import GPU_SPECS
    from sluice.engine.flags import add_engine_args

    parser = bench_sub.add_parser(
        "throughput", help="offline throughput on nano-vllm's workload, against the roofline")
    parser.add_argument("--num-requests", type=int, default=NANO_VLLM_NUM_REQUESTS)
    parser.add_argument("--max-input-len", type=int, default=NANO_VLLM_MAX_INPUT_LEN,
                        help="longest prompt (shortest: 100/1024 of it)")
    parser.add_argument("--max-output-len", type=int, default=NANO_VLLM_MAX_OUTPUT_LEN,
                        help="largest max_tokens (smallest: 100/1024 of it)")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--hf-baseline", action="store_true",
                        help="also time transformers' continuous batching on the same device")
    parser.add_argument("--gpu-spec", default="auto",
                        help=f"roofline hardware: auto | {' | '.join(GPU_SPECS)} "
                             "(auto: from the GPU's name, else h200)")
    parser.add_argument("--repeat", type=int, default=0,
                        help="time the workload this many more times in the same process")
    parser.add_argument("--repeat-cached", type=int, default=0,
                        help="then this many more, keeping the prompts cached by the run "
                             "before (--repeat resets the prefix cache before each run)")
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    add_engine_args(parser)
    parser.set_defaults(func=_cmd_throughput)


def build_llm(ns: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The LLM of the engine flags (the random Qwen3-0.6B if no --model), its device and dtype."""
    from sluice import LLM
    from sluice.bench.workloads import benchmark_model_dir, cache_root
    from sluice.engine.flags import engine_args_from
    from sluice.model.loader import resolve_dtype
    from sluice.worker.model_runner import resolve_device

    engine_args = engine_args_from(ns)
    if engine_args.model is None:
        engine_args.model = benchmark_model_dir(cache_root(dict(os.environ)))
    llm = LLM(**vars(engine_args))
    hf_config = llm.llm_engine.hf_config
    return llm, resolve_device(engine_args.device), resolve_dtype(engine_args.dtype, hf_config)


def release_device_memory(device: Any) -> None:
    """After the last reference to an engine is dropped: give its KV cache back to the device."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed_generate(llm: Any, prompts: list[list[int]], params: list[Any],
                    device: Any) -> tuple[list[Any], float]:
    from sluice.bench.offline_report import synchronize

    synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    synchronize(device)
    return outputs, time.perf_counter() - start


def run_throughput(ns: argparse.Namespace) -> dict[str, Any]:
    from sluice import SamplingParams
    from sluice.attention.kv_layout import resolve_kv_cache_dtype
    from sluice.bench.hf_baseline import HFBaselineResult, measure_hf_baseline
    from sluice.bench.record import make_record
    from sluice.bench.roofline import ModelCost, gpu_spec_for, offline_roofline
    from sluice.bench.workloads import nano_vllm_workload, random_prompts

    for flag, value in (("--repeat", ns.repeat), ("--repeat-cached", ns.repeat_cached)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    workload = nano_vllm_workload(ns.num_requests, ns.max_input_len, ns.max_output_len)
    gpu_spec_for(ns.gpu_spec)  # a bad name fails before the model loads
    llm, device, dtype = build_llm(ns)
    engine = llm.llm_engine
    hf_config = engine.hf_config
    model_dir = engine.model_config.model
    workload = workload.fold_token_ids(hf_config.vocab_size)

    warmup = random_prompts(_WARMUP_REQUESTS, _WARMUP_PROMPT_LEN, hf_config.vocab_size,
                            random.Random(1))
    _timed_generate(llm, warmup, [SamplingParams(temperature=ns.temperature, ignore_eos=True,
                                                 max_tokens=_WARMUP_MAX_TOKENS)] * len(warmup),
                    device)
    params = [SamplingParams(temperature=ns.temperature, ignore_eos=True, max_tokens=m)
              for m in workload.max_tokens]
    outputs, seconds = _timed_generate(llm, workload.prompts, params, device)
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    runs = [_run_record(outputs, seconds, prefix_cache="reset")]
    for keep in [False] * ns.repeat + [True] * ns.repeat_cached:
        if not keep:
            llm.reset_prefix_cache()
        again, again_s = _timed_generate(llm, workload.prompts, params, device)
        runs.append(_run_record(again, again_s, prefix_cache="kept" if keep else "reset"))
        del again
    llm.shutdown()  # the HF baseline needs the memory the KV cache held
    del llm, engine, outputs
    release_device_memory(device)

    record = make_record("throughput", {}, device=device,
                         command=getattr(ns, "sluice_argv", None))
    machine = record["machine"]
    spec = gpu_spec_for(ns.gpu_spec, machine["gpu"])
    kv_dtype = resolve_kv_cache_dtype(ns.kv_cache_dtype, dtype)
    cost = ModelCost.from_hf_config(hf_config, dtype.itemsize, kv_dtype.itemsize)
    roofline = offline_roofline(cost, [len(p) for p in workload.prompts], generated, spec)
    output_tokens = sum(generated)
    output_tok_s = output_tokens / seconds
    results: dict[str, Any] = {
        "model": model_dir,
        "architecture": hf_config.architectures[0],
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "device": str(device),
        "num_requests": workload.num_requests,
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": workload.output_tokens,
        "seconds": seconds,
        "output_tok_s": output_tok_s,
        "total_tok_s": (workload.prompt_tokens + output_tokens) / seconds,
        "gpu_spec": {"name": spec.name, "hbm_bytes_per_s": spec.hbm_bytes_per_s,
                     "dense_flops_per_s": spec.dense_flops_per_s},
        "roofline_seconds": roofline.seconds,
        "roofline_decode_bytes": roofline.decode_bytes,
        "roofline_prefill_flops": roofline.prefill_flops,
        "roofline_tok_s": roofline.output_tok_s,
        "roofline_fraction": output_tok_s / roofline.output_tok_s,
        "runs": runs,
        "hf_tok_s": None,
        "hf_seconds": None,
        "hf_output_tokens": None,
        "hf_attn_implementation": None,
        "hf_unavailable_reason": None,
        "ratio_vs_hf": None,
    }
    if ns.hf_baseline:
        try:
            hf = measure_hf_baseline(model_dir, workload.prompts, generated, dtype, device,
                                     ns.temperature)
        except Exception as e:  # reported, not raised: the sluice figure above still stands
            hf = HFBaselineResult(transformers_version="",
                                  unavailable_reason=f"it failed: {type(e).__name__}: {e}")
        results.update(hf_tok_s=hf.output_tok_s, hf_unavailable_reason=hf.unavailable_reason,
                       hf_attn_implementation=hf.attn_implementation or None,
                       hf_transformers_version=hf.transformers_version or None)
        if hf.output_tok_s is not None:
            results.update(hf_seconds=hf.seconds, hf_output_tokens=hf.output_tokens,
                           ratio_vs_hf=output_tok_s / hf.output_tok_s)
    record["results"] = results
    return record


def _run_record(outputs: list[Any], seconds: float, prefix_cache: str) -> dict[str, Any]:
    """One timed run: its time, output tok/s and the prompt tokens the prefix cache served."""
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "output_tok_s": tokens / seconds, "prefix_cache": prefix_cache,
            "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs)}


def format_throughput(record: dict[str, Any], hf_requested: bool) -> str:
    from sluice.bench.record import command_text, describe_machine

    results = record["results"]
    spec = results["gpu_spec"]
    lines = [
        f"command: {command_text(record)}",
        f"machine: {describe_machine(record['machine'])}",
        f"model: {results['model']} ({results['architecture']}, {results['dtype']}, "
        f"{results['device']})",
        f"workload: {results['num_requests']} requests, {results['prompt_tokens']:,} prompt "
        f"tokens, {results['output_tokens']:,} output tokens",
        f"sluice: {results['seconds']:.2f} s, {results['output_tok_s']:,.0f} output tok/s, "
        f"{results['total_tok_s']:,.0f} total tok/s",
        f"roofline ({spec['name']} spec: {spec['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"{spec['dense_flops_per_s'] / 1e12:.0f} TFLOP/s): {results['roofline_tok_s']:,.0f} "
        f"output tok/s ({results['roofline_seconds']:.2f} s); reached "
        f"{100 * results['roofline_fraction']:.1f}%",
    ]
    for i, run in enumerate(results.get("runs", [])[1:], 2):
        lines.append(f"run {i} (prefix cache {run['prefix_cache']}): {run['seconds']:.2f} s, "
                     f"{run['output_tok_s']:,.0f} output tok/s, "
                     f"{run['cached_prompt_tokens']:,} prompt tokens from the prefix cache")
    if hf_requested and results["hf_tok_s"] is not None:
        lines.append(
            f"HF transformers {results['hf_transformers_version']} continuous batching "
            f"({results['hf_attn_implementation']}): {results['hf_seconds']:.2f} s, "
            f"{results['hf_tok_s']:,.0f} output tok/s; sluice / HF = {results['ratio_vs_hf']:.2f}x")
    elif hf_requested:
        lines.append(f"HF baseline unavailable: {results['hf_unavailable_reason']}")
    return "\n".join(lines)


def _cmd_throughput(ns: argparse.Namespace) -> int:
    from sluice.bench.record import write_record

    record = run_throughput(ns)
    print(format_throughput(record, ns.hf_baseline))
    if ns.output:
        write_record(ns.output, record)
    return 0
