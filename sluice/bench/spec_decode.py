"""`sluice bench spec`: decode speed with speculative decoding against none, in the same run.

Per batch size B: B greedy requests to `output_len` tokens each, timed (median of `num_iters`)
on an engine without speculation and on an engine with `--speculative-config` (n-gram prompt
lookup by default). Both engines are up at once (each with half of `--gpu-memory-utilization`)
and their timed runs alternate, so that drift of the machine lands on both alike. Decode time
is the time to `output_len` tokens less the time to one token (prefill), as in `sluice bench
latency`; the speed-up is the ratio of the two decode times.
Acceptance figures are counted over the timed runs of the speculative engine, and so are the
drafting policy's decisions (sluice/spec_decode/policy.py): the share of steps that drafted, and
of those that did not, how many for the batch size and how many for low acceptance. Both engines
see the same prompts, each several times (so the prompt is a prefix-cache hit after the first run,
alike for both). The speculative config is given with the policy's fields filled in (defaults
when not given), as the engine ran it.

Workloads (`--workload`): `continue`, prompts that are a random segment followed by the model's
own greedy continuation of it (made by the baseline engine first), so that the output goes on
with what the prompt already holds: with a random-weight model that is a loop it has fallen
into, the case of outputs that repeat their prompts (editing, extraction), where prompt lookup
pays; `repeat`, prompts that are one random segment repeated (whether the output picks the
pattern up is up to the model); `random`, prompts of random tokens (prompt lookup finds little:
the cost of speculating for nothing). The acceptance rate says how much the output did repeat,
and
`tokens_equal` how many output tokens equal the run without speculation (greedy: all, up to
floating-point ties between a batched verification and a one-token decode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from typing import Any

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, ' \
               '"prompt_lookup_min": 2}'


def add_parser(bench_sub: Any) -> None:
    from sluice.entrypoints.cli import add_engine_args

    parser = bench_sub.add_parser(
        "spec", help="decode speed-up of speculative decoding vs none, same run")
    parser.add_argument("--batch-sizes", default="1,8,32,128",
                        help="comma-separated (default 1,8,32,128)")
    parser.add_argument("--workload", choices=["continue", "repeat", "random"],
                        default="continue")
    parser.add_argument("--segment-len", type=int, default=64,
                        help="continue / repeat workloads: tokens in the random segment")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=256, help="tokens per request")
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs per point (median)")
    parser.add_argument("--bench-speculative-config", default=DEFAULT_SPEC,
                        help=f"the speculative engine's config (default: {DEFAULT_SPEC}); "
                             "'none': a second engine without speculation, the benchmark's "
                             "noise floor (an A/A run)")
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    add_engine_args(parser)
    parser.set_defaults(func=_cmd_spec)


def make_prompts(workload: str, num: int, input_len: int, segment_len: int, vocab_size: int,
                 rng: random.Random) -> list[list[int]]:
    from sluice.bench.workloads import random_prompts

    if workload in ("random", "continue"):  # continue: the segment, continued by run_spec
        return random_prompts(num, input_len if workload == "random" else segment_len,
                              vocab_size, rng)
    segments = random_prompts(num, segment_len, vocab_size, rng)
    return [(s * (input_len // segment_len + 1))[:input_len] for s in segments]


def run_spec(ns: argparse.Namespace) -> dict[str, Any]:
    from sluice import SamplingParams
    from sluice.bench import offline_report as report
    from sluice.bench.latency import parse_sizes
    from sluice.bench.throughput import build_llm, release_device_memory
    from sluice.spec_decode.config import SpeculativeConfig

    batch_sizes = parse_sizes("batch_sizes", ns.batch_sizes)
    # Validated, with the defaults filled in: the record says which policy ran.
    spec_config: dict[str, Any] | None = None
    if ns.bench_speculative_config != "none":
        config = SpeculativeConfig.from_dict(ns.bench_speculative_config)
        if config is None:
            raise ValueError("--bench-speculative-config must be a speculative config to "
                             f"measure or 'none', got {ns.bench_speculative_config!r}")
        spec_config = dataclasses.asdict(config)
    # Both engines live at once, each on half the memory, and their timed runs alternate: drift
    # of the machine (clocks, a neighbour) over a run then lands on both alike. Measured one
    # engine after the other on an H100, two engines doing the same work (drafting off) differed
    # by up to 10% from one call to the next.
    if ns.gpu_memory_utilization is not None:
        ns.gpu_memory_utilization = ns.gpu_memory_utilization / 2
    names = ("baseline", "speculative")
    engines: dict[str, Any] = {}
    for name in names:
        ns.speculative_config = spec_config if name == "speculative" else None
        engines[name] = build_llm(ns)
    llm, device, dtype = engines["baseline"]
    engine = llm.llm_engine
    machine, model = report.machine_info(device), engine.model_config.model
    dtype_name = str(dtype).removeprefix("torch.")
    rng = random.Random(ns.seed)
    prompts = {b: make_prompts(ns.workload, b, ns.input_len, ns.segment_len,
                               engine.hf_config.vocab_size, rng) for b in batch_sizes}

    def timed(name: str, batch: list[list[int]], max_tokens: int
              ) -> tuple[float, list[list[int]]]:
        llm = engines[name][0]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        report.synchronize(device)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        report.synchronize(device)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    if ns.workload == "continue":
        for b in batch_sizes:
            _, continuations = timed("baseline", prompts[b], ns.input_len - ns.segment_len)
            prompts[b] = [p + c for p, c in zip(prompts[b], continuations)]
    for name in names:
        timed(name, prompts[max(batch_sizes)], 16)  # warm-up
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    outputs_by_engine: dict[str, dict[int, list[list[int]]]] = {name: {} for name in names}
    spec_llm = engines["speculative"][0]
    for b in batch_sizes:
        before = spec_llm.get_spec_decoding_stats()
        runs: dict[str, list[tuple[float, list[list[int]]]]] = {name: [] for name in names}
        t_1s: dict[str, list[float]] = {name: [] for name in names}
        for i in range(ns.num_iters):
            for name in names if i % 2 == 0 else names[::-1]:
                runs[name].append(timed(name, prompts[b], ns.output_len))
        after = spec_llm.get_spec_decoding_stats()
        for i in range(ns.num_iters):
            for name in names if i % 2 == 0 else names[::-1]:
                t_1s[name].append(timed(name, prompts[b], 1)[0])
        for name in names:
            t_out = statistics.median(t for t, _ in runs[name])
            t_1 = statistics.median(t_1s[name])
            decode_s = max(t_out - t_1, 1e-9)
            point = {"batch_size": b, "t_out_s": t_out, "t_1_s": t_1,
                     "itl_ms": 1e3 * decode_s / (ns.output_len - 1),
                     "decode_tok_s": b * (ns.output_len - 1) / decode_s}
            if name == "speculative" and after is not None:
                drafts = after.num_drafts - before.num_drafts
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                steps = {key: getattr(after, key) - getattr(before, key)
                         for key in ("num_steps_drafting", "num_steps_off_batch_size",
                                     "num_steps_off_acceptance")}
                num_steps = sum(steps.values())
                point.update(num_drafts=drafts, num_draft_tokens=drafted,
                             num_accepted_tokens=accepted,
                             acceptance_rate=accepted / drafted if drafted else 0.0,
                             mean_acceptance_length=1 + accepted / drafts if drafts else 0.0,
                             **steps, drafting_step_fraction=(
                                 steps["num_steps_drafting"] / num_steps if num_steps else 0.0),
                             # Decode tokens per request per counted step (the prefill's step
                             # ran with no request running: not counted).
                             tokens_per_step=(ns.num_iters * (ns.output_len - 1) / num_steps
                                              if num_steps else 0.0))
            results[name][b] = point
            outputs_by_engine[name][b] = runs[name][0][1]
    for name in names:
        engines[name][0].shutdown()
    engines.clear()
    del llm, engine, spec_llm
    release_device_memory(device)

    points = []
    for b in batch_sizes:
        base, spec = results["baseline"][b], results["speculative"][b]
        ref, got = outputs_by_engine["baseline"][b], outputs_by_engine["speculative"][b]
        equal = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
        points.append({**spec, "baseline_itl_ms": base["itl_ms"],
                       "baseline_decode_tok_s": base["decode_tok_s"],
                       "speedup": spec["decode_tok_s"] / base["decode_tok_s"],
                       "tokens_equal": equal / sum(len(r) for r in ref)})
    return {
        "machine": machine, "gpu": machine["gpu"], "command": report.command_line(None),
        "model": model, "dtype": dtype_name, "workload": ns.workload,
        "input_len": ns.input_len, "segment_len": ns.segment_len, "output_len": ns.output_len,
        "num_iters": ns.num_iters, "speculative_config": spec_config, "points": points,
        "sluice_version": report.sluice_version(), "date": report.now_iso(),
    }


def format_spec(record: dict[str, Any]) -> str:
    from sluice.bench.offline_report import describe_machine

    lines = [
        f"command: {record['command']}",
        f"machine: {describe_machine(record['machine'])}",
        f"model: {record['model']} ({record['dtype']}); workload {record['workload']}: "
        f"{record['input_len']} prompt tokens, {record['output_len']} output tokens, greedy",
        f"speculative: {json.dumps(record['speculative_config'])}",
        f"{'batch':>6} {'ITL base':>9} {'ITL spec':>9} {'speed-up':>9} {'accept':>7} "
        f"{'mean len':>9} {'tok/step':>9} {'drafted':>8} {'off:batch':>10} {'off:accept':>11} "
        f"{'equal':>6}",
    ]
    lines += [f"{p['batch_size']:>6} {p['baseline_itl_ms']:>9.3f} {p['itl_ms']:>9.3f} "
              f"{p['speedup']:>8.2f}x {p.get('acceptance_rate', 0):>7.1%} "
              f"{p.get('mean_acceptance_length', 0):>9.2f} {p.get('tokens_per_step', 0):>9.2f} "
              f"{p.get('drafting_step_fraction', 0):>8.1%} "
              f"{p.get('num_steps_off_batch_size', 0):>10} "
              f"{p.get('num_steps_off_acceptance', 0):>11} {p['tokens_equal']:>6.1%}"
              for p in record["points"]]
    lines.append("tok/step: decode tokens per request and step; drafted: share of the timed "
                 "steps that drafted (the drafting policy); off: steps without drafts for the "
                 "batch size / for low acceptance")
    return "\n".join(lines)


def _cmd_spec(ns: argparse.Namespace) -> int:
    from sluice.bench.offline_report import write_json

    if ns.output_len < 2:
        raise ValueError(f"output_len must be >= 2, got {ns.output_len}")
    if ns.workload != "random" and not 1 <= ns.segment_len < ns.input_len:
        raise ValueError(f"segment_len must be in [1, input_len) for workload {ns.workload!r}, "
                         f"got segment_len {ns.segment_len}, input_len {ns.input_len}")
    record = run_spec(ns)
    print(format_spec(record))
    if ns.output:
        write_json(ns.output, record)
    return 0
