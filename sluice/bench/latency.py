"""`sluice bench latency`: decode inter-token latency per batch size, and time to first token.

ITL at batch size B: the median time of a generate of B prompts of `input_len` tokens to
`output_len` tokens each (t_out), less the median time of the same shape to one token (t_1, the
prefill and first token), over the `output_len - 1` decode steps between:
`ITL = (t_out - t_1) / (output_len - 1)`. TTFT at prefill length L: the median time of a
generate of one L-token prompt to one token. Every timed generate gets fresh random prompts, so
no run is served from another's prefix cache.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DecodeLatency:
    batch_size: int
    itl_ms: float  # per decode step, which gives every sequence of the batch one token
    output_tok_s: float  # batch_size tokens per step
    t_out_s: float  # median time to output_len tokens
    t_1_s: float  # median time to one token


@dataclass(frozen=True, slots=True)
class PrefillLatency:
    prefill_len: int
    ttft_ms: float  # median


def parse_sizes(name: str, text: str) -> list[int]:
    """"1,64" -> [1, 64]; every entry an integer >= 1."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{name} must be a comma-separated list of integers >= 1, got {text!r}")
    return sizes


def add_parser(bench_sub: Any) -> None:
    from sluice.engine.flags import add_engine_args

    parser = bench_sub.add_parser(
        "latency", help="decode inter-token latency per batch size and TTFT per prompt length")
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated (default: 1,64)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens in decode runs")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per decode run")
    parser.add_argument("--prefill-lens", default="1024,8192",
                        help="prompt lengths for TTFT, comma-separated (default: 1024,8192)")
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs per point (median)")
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    add_engine_args(parser)
    parser.set_defaults(func=_cmd_latency)


def _validate(ns: argparse.Namespace, batch_sizes: list[int], prefill_lens: list[int],
              max_model_len: int, max_num_seqs: int) -> None:
    if ns.input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {ns.input_len}")
    if ns.output_len < 2:
        raise ValueError(f"output_len must be >= 2 (ITL needs two timed lengths), "
                         f"got {ns.output_len}")
    if ns.num_iters < 1:
        raise ValueError(f"num_iters must be >= 1, got {ns.num_iters}")
    if ns.input_len + ns.output_len > max_model_len:
        raise ValueError(f"input_len + output_len ({ns.input_len + ns.output_len}) must be <= "
                         f"max_model_len ({max_model_len})")
    if max(prefill_lens) >= max_model_len:
        raise ValueError(f"prefill lengths must be < max_model_len ({max_model_len}), "
                         f"got {max(prefill_lens)}")
    if max(batch_sizes) > max_num_seqs:
        raise ValueError(f"batch sizes must be <= max_num_seqs ({max_num_seqs}) so that the "
                         f"whole batch decodes together, got {max(batch_sizes)}")


def run_latency(ns: argparse.Namespace) -> dict[str, Any]:
    from sluice import SamplingParams
    from sluice.bench import offline_report as report
    from sluice.bench.record import make_record
    from sluice.bench.throughput import build_llm
    from sluice.bench.workloads import random_prompts

    batch_sizes = parse_sizes("batch_sizes", ns.batch_sizes)
    prefill_lens = parse_sizes("prefill_lens", ns.prefill_lens)
    llm, device, dtype = build_llm(ns)
    engine = llm.llm_engine
    _validate(ns, batch_sizes, prefill_lens, engine.scheduler_config.max_model_len,
              engine.scheduler_config.max_num_seqs)
    vocab_size = engine.hf_config.vocab_size
    rng = random.Random(ns.seed)

    def time_generate(num_prompts: int, prompt_len: int, max_tokens: int) -> float:
        prompts = random_prompts(num_prompts, prompt_len, vocab_size, rng)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        report.synchronize(device)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        report.synchronize(device)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return elapsed

    # Warm-up: the largest batch through a few decode steps, and the shortest prefill.
    time_generate(max(batch_sizes), ns.input_len, min(ns.output_len, 8))
    time_generate(1, min(prefill_lens), 1)

    decode: list[DecodeLatency] = []
    for batch_size in batch_sizes:
        t_out = statistics.median(time_generate(batch_size, ns.input_len, ns.output_len)
                                  for _ in range(ns.num_iters))
        t_1 = statistics.median(time_generate(batch_size, ns.input_len, 1)
                                for _ in range(ns.num_iters))
        # Timer noise can make t_out - t_1 tiny or negative on very short runs; keep it > 0.
        step_s = max(t_out - t_1, 1e-9) / (ns.output_len - 1)
        decode.append(DecodeLatency(batch_size, 1e3 * step_s, batch_size / step_s, t_out, t_1))
    prefill = [
        PrefillLatency(length, 1e3 * statistics.median(time_generate(1, length, 1)
                                                       for _ in range(ns.num_iters)))
        for length in prefill_lens
    ]

    return make_record("latency", {
        "model": engine.model_config.model,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "num_iters": ns.num_iters,
        "decode": [asdict(d) for d in decode],
        "prefill": [asdict(p) for p in prefill],
    }, device=device, command=getattr(ns, "sluice_argv", None))


def format_latency(record: dict[str, Any]) -> str:
    from sluice.bench.record import command_text, describe_machine

    results = record["results"]
    lines = [
        f"command: {command_text(record)}",
        f"machine: {describe_machine(record['machine'])}",
        f"model: {results['model']} ({results['dtype']}, {results['device']})",
        f"decode: {results['input_len']} prompt tokens, {results['output_len']} output tokens, "
        f"median of {results['num_iters']}",
        f"{'batch':>8} {'ITL (ms/token)':>16} {'decode tok/s':>14}",
    ]
    lines += [f"{d['batch_size']:>8} {d['itl_ms']:>16.3f} {d['output_tok_s']:>14,.0f}"
              for d in results["decode"]]
    lines.append(f"{'prefill':>8} {'TTFT (ms)':>16}")
    lines += [f"{p['prefill_len']:>8} {p['ttft_ms']:>16.3f}" for p in results["prefill"]]
    return "\n".join(lines)


def _cmd_latency(ns: argparse.Namespace) -> int:
    from sluice.bench.record import write_record

    record = run_latency(ns)
    print(format_latency(record))
    if ns.output:
        write_record(ns.output, record)
    return 0
