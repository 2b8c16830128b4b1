"""`sluice bench spec`: decode speed with speculative decoding against none, in the same run.

Per batch size B: B greedy requests to `output_len` tokens each, timed (median of `num_iters`)
on an engine without speculation and on an engine with `--speculative-config` (n-gram prompt
lookup by default). Both engines are up at once (each with half of `--gpu-memory-utilization`;
the record gives each one's KV blocks) and their timed runs alternate, A B, B A, A B, ... Decode
time is the time to `output_len` tokens less the time to one token (prefill), as in `sluice bench
latency`, per iteration; each engine's ITL and tok/s come from the median of its iterations'.
The speed-up is the median, over every two consecutive iterations (A B B A), of the ratio of
the two engines' decode times in them: a drift of the machine's speed linear in time lands on
both alike, and a change of speed in the middle of a point moves only the ratios of the
iterations around it. (The ratio of each engine's median did neither: the two engines' runs sit
at different places in the order, so a change of speed between them went whole to one engine.)
`speedup_min` / `speedup_max` give the spread over those ratios.
Acceptance figures are counted over the timed runs of the speculative engine, and so are the
drafting policy's decisions (sluice/spec_decode/policy.py): the share of steps that drafted, and
of those that did not, how many for the batch size and how many for low acceptance. Both engines
see the same prompts, and before a point's timed runs each runs them once untimed: every timed
run is then a prefix-cache hit on both (the record gives each engine's hit rate), and the point's
shapes have run once. The speculative config is given with the policy's fields filled in
(defaults when not given), as the engine ran it.

Workloads (`--workload`): `continue`, prompts that are a random segment followed by the model's
own greedy continuation of it (made by the baseline engine first), so that the output goes on
with what the prompt already holds: with a random-weight model that is a loop it has fallen
into, the case of outputs that repeat their prompts (editing, extraction), where prompt lookup
pays; `repeat`, prompts that are one random segment repeated (whether the output picks the
pattern up is up to the model); `random`, prompts of random tokens (prompt lookup finds little:
the cost of speculating for nothing). On a trained chat model, two real-text workloads
(sluice/bench/text_prompts.py), each prompt a conversation rendered with the model's chat
template and each reply ending where the model ends it (EOS, or `--output-len`): `copy`, answers
that repeat much of their prompt (summarise, proofread or repeat a paragraph, repeat code with a
change), and `chat`, open-ended questions. There ITL and tok/s count the tokens each engine's
replies have (the same on both, greedy, unless 16-bit rounding parts them: then the speed-up
compares time per token), ITL over the longest reply of the batch. The acceptance rate
says how much the output did repeat, and `tokens_equal` how many output tokens equal the run
without speculation (greedy: all, up to floating-point ties between a batched verification and
a one-token decode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from typing import Any

# Untimed tokens per engine and point before its timed runs.
_WARMUP_TOKENS = 16
# Real text through the chat template (needs a trained chat model).
TEXT_WORKLOADS = ("copy", "chat")
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, ' \
               '"prompt_lookup_min": 2}'


def add_parser(bench_sub: Any) -> None:
    from sluice.engine.flags import add_engine_args

    parser = bench_sub.add_parser(
        "spec", help="decode speed-up of speculative decoding vs none, same run")
    parser.add_argument("--batch-sizes", default="1,8,32,128",
                        help="comma-separated (default 1,8,32,128)")
    parser.add_argument("--workload", choices=["continue", "repeat", "random", *TEXT_WORKLOADS],
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


def text_prompts(llm: Any, workload: str, num: int) -> list[list[int]]:
    """`num` prompts of a real-text workload, rendered with the model's chat template."""
    from sluice.bench.text_prompts import conversations

    tokenizer = llm.get_tokenizer()
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"workload {workload!r} needs a chat model: the tokenizer of "
                         f"{llm.llm_engine.model_config.model!r} has no chat template")
    prompts = []
    for conversation in conversations(workload, num):
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        prompts.append(list(ids))
    return prompts


def run_order(names: tuple[str, str], iteration: int) -> tuple[str, str]:
    """Which engine runs first in an iteration: they alternate (A B, B A, A B, ...), so that any
    two consecutive iterations are A B B A or B A A B."""
    return names if iteration % 2 == 0 else names[::-1]


def paired_speedups(baseline_s: list[float], speculative_s: list[float]) -> list[float]:
    """Speed-ups (baseline time / speculative time) from the decode times of the iterations, in
    run_order: one per two consecutive iterations (A B B A: a drift of the machine's speed
    linear in time lands on both engines alike; a change of speed moves the one or two that
    straddle it), or the one pair's with a single iteration."""
    if len(baseline_s) != len(speculative_s) or not baseline_s:
        raise ValueError(f"need as many runs of each engine, at least one; got "
                         f"{len(baseline_s)} and {len(speculative_s)}")
    if len(baseline_s) == 1:
        return [baseline_s[0] / speculative_s[0]]
    return [(baseline_s[i] + baseline_s[i + 1]) / (speculative_s[i] + speculative_s[i + 1])
            for i in range(len(baseline_s) - 1)]


def run_spec(ns: argparse.Namespace) -> dict[str, Any]:
    from sluice import SamplingParams
    from sluice.bench import offline_report as report
    from sluice.bench.latency import parse_sizes
    from sluice.bench.record import make_record
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
    model = engine.model_config.name or engine.model_config.model
    dtype_name = str(dtype).removeprefix("torch.")
    rng = random.Random(ns.seed)
    text = ns.workload in TEXT_WORKLOADS
    if text:
        prompts = {b: text_prompts(llm, ns.workload, b) for b in batch_sizes}
    else:
        prompts = {b: make_prompts(ns.workload, b, ns.input_len, ns.segment_len,
                                   engine.hf_config.vocab_size, rng) for b in batch_sizes}

    def timed(name: str, batch: list[list[int]], max_tokens: int
              ) -> tuple[float, list[list[int]]]:
        llm = engines[name][0]
        params = SamplingParams(temperature=0.0, ignore_eos=not text, max_tokens=max_tokens)
        report.synchronize(device)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        report.synchronize(device)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    if ns.workload == "continue":
        for b in batch_sizes:
            _, continuations = timed("baseline", prompts[b], ns.input_len - ns.segment_len)
            prompts[b] = [p + c for p, c in zip(prompts[b], continuations)]

    def prefix_cache_counters(name: str) -> tuple[int, int]:
        manager = engines[name][0].llm_engine.kv_cache_manager
        return manager.prefix_cache_queries, manager.prefix_cache_hits

    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    outputs_by_engine: dict[str, dict[int, list[list[int]]]] = {name: {} for name in names}
    spec_llm = engines["speculative"][0]
    for b in batch_sizes:
        # Untimed, on each engine: the point's prompts enter its prefix cache, so that every
        # timed run of either engine is a hit whatever ran before (with `continue` the baseline
        # made the prompts and held them already), and the point's shapes (graph sizes, at
        # batch 1 the drafting path) run once before they are timed.
        for name in names:
            timed(name, prompts[b], _WARMUP_TOKENS)
        before = spec_llm.get_spec_decoding_stats()
        counters_before = {name: prefix_cache_counters(name) for name in names}
        runs: dict[str, list[tuple[float, list[list[int]]]]] = {name: [] for name in names}
        t_1s: dict[str, list[float]] = {name: [] for name in names}
        for i in range(ns.num_iters):
            for name in run_order(names, i):
                runs[name].append(timed(name, prompts[b], ns.output_len))
        after = spec_llm.get_spec_decoding_stats()
        counters_after = {name: prefix_cache_counters(name) for name in names}
        for i in range(ns.num_iters):
            for name in run_order(names, i):
                t_1s[name].append(timed(name, prompts[b], 1)[0])
        decode_runs = {name: [max(t - t_1, 1e-9) for (t, _), t_1 in zip(runs[name], t_1s[name])]
                       for name in names}
        # Each engine's decode tokens: the batch's after each request's first, and per step the
        # longest reply's. The same on both unless their greedy replies part (16-bit rounding
        # of a batched verification against a one-token decode): then time per token compares.
        lengths = {name: [len(tokens) for tokens in runs[name][0][1]] for name in names}
        decode_tokens = {name: max(sum(lengths[name]) - b, 1) for name in names}
        steps_tokens = {name: max(max(lengths[name]) - 1, 1) for name in names}
        speedups = paired_speedups(
            [t / decode_tokens["baseline"] for t in decode_runs["baseline"]],
            [t / decode_tokens["speculative"] for t in decode_runs["speculative"]])
        for name in names:
            t_out = statistics.median(t for t, _ in runs[name])
            t_1 = statistics.median(t_1s[name])
            # The iterations' decode times, as the speed-ups take them: a run to one token
            # timed longer than the full run (a loaded machine) clamps both alike.
            decode_s = statistics.median(decode_runs[name])
            queries, hits = (a - z for a, z in zip(counters_after[name], counters_before[name]))
            point = {"batch_size": b, "t_out_s": t_out, "t_1_s": t_1,
                     "itl_ms": 1e3 * decode_s / steps_tokens[name],
                     "decode_tok_s": decode_tokens[name] / decode_s,
                     "mean_output_len": sum(lengths[name]) / b,
                     "mean_prompt_len": sum(map(len, prompts[b])) / b,
                     "prefix_cache_hit_rate": hits / queries if queries else 0.0}
            if name == "speculative":
                point.update(speedup=statistics.median(speedups), speedup_min=min(speedups),
                             speedup_max=max(speedups))
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
                             tokens_per_step=(ns.num_iters * steps_tokens[name] / num_steps
                                              if num_steps else 0.0))
            results[name][b] = point
            outputs_by_engine[name][b] = runs[name][0][1]
    num_gpu_blocks = {name: engines[name][0].llm_engine.kv_cache_manager.block_pool.num_blocks
                      for name in names}
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
                       "baseline_prefix_cache_hit_rate": base["prefix_cache_hit_rate"],
                       "tokens_equal": equal / sum(len(r) for r in ref)})
    return make_record("spec", {
        "model": model, "dtype": dtype_name, "workload": ns.workload,
        "input_len": ns.input_len, "segment_len": ns.segment_len, "output_len": ns.output_len,
        "num_iters": ns.num_iters, "speculative_config": spec_config,
        "num_gpu_blocks": num_gpu_blocks, "points": points,
    }, device=device, command=getattr(ns, "sluice_argv", None))


def format_spec(record: dict[str, Any]) -> str:
    from sluice.bench.record import command_text, describe_machine

    results = record["results"]
    lines = [
        f"command: {command_text(record)}",
        f"machine: {describe_machine(record['machine'])}",
        f"model: {results['model']} ({results['dtype']}); workload {results['workload']}: "
        + (f"chat prompts of {results['points'][0]['mean_prompt_len']:.0f} tokens on average "
           f"(batch {results['points'][0]['batch_size']}), replies up to "
           f"{results['output_len']} tokens (EOS ends them), greedy"
           if results["workload"] in TEXT_WORKLOADS else
           f"{results['input_len']} prompt tokens, {results['output_len']} output tokens, "
           "greedy"),
        f"speculative: {json.dumps(results['speculative_config'])}",
        f"{'batch':>6} {'ITL base':>9} {'ITL spec':>9} {'speed-up':>9} {'range':>11} {'accept':>7} "
        f"{'mean len':>9} {'tok/step':>9} {'drafted':>8} {'off:batch':>10} {'off:accept':>11} "
        f"{'equal':>6} {'out len':>8}",
    ]
    lines += [f"{p['batch_size']:>6} {p['baseline_itl_ms']:>9.3f} {p['itl_ms']:>9.3f} "
              f"{p['speedup']:>8.2f}x {p['speedup_min']:>5.2f}-{p['speedup_max']:<5.2f} "
              f"{p.get('acceptance_rate', 0):>7.1%} "
              f"{p.get('mean_acceptance_length', 0):>9.2f} {p.get('tokens_per_step', 0):>9.2f} "
              f"{p.get('drafting_step_fraction', 0):>8.1%} "
              f"{p.get('num_steps_off_batch_size', 0):>10} "
              f"{p.get('num_steps_off_acceptance', 0):>11} {p['tokens_equal']:>6.1%} "
              f"{p.get('mean_output_len', results['output_len']):>8.1f}"
              for p in results["points"]]
    lines.append("speed-up: median over consecutive iterations (A B B A) of baseline / "
                 "speculative decode time, range: their spread; tok/step: decode tokens per "
                 "request and step; drafted: share of the timed steps that drafted (the drafting "
                 "policy); off: steps without drafts for the batch size / for low acceptance; "
                 "out len: tokens per reply (mean)")
    return "\n".join(lines)


def _cmd_spec(ns: argparse.Namespace) -> int:
    from sluice.bench.record import write_record

    if ns.output_len < 2:
        raise ValueError(f"output_len must be >= 2, got {ns.output_len}")
    if ns.workload in ("continue", "repeat") and not 1 <= ns.segment_len < ns.input_len:
        raise ValueError(f"segment_len must be in [1, input_len) for workload {ns.workload!r}, "
                         f"got segment_len {ns.segment_len}, input_len {ns.input_len}")
    record = run_spec(ns)
    print(format_spec(record))
    if ns.output:
        write_record(ns.output, record)
    return 0
