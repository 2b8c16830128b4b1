"""`sluice bench structured`: the cost of structured outputs on nano-vllm's offline workload.

The same workload (`sluice bench throughput`'s: prompts, max_tokens, temperature 0.6,
ignore_eos) is generated once per fraction of json_schema requests (default 0% and 50%), in
the same process on the same engine, and each run's output tokens per second is reported with
its ratio to the 0% run. Every k-th request of a constrained run carries
`structured_outputs=StructuredOutputsParams(json=SCHEMA)`: an object whose last field is an
array of strings with no bound, so a reply may run to its max_tokens as an unconstrained one
does, unless the model closes the array (then the grammar ends it: the constrained requests'
outputs are counted and reported). The grammar is compiled in the warm-up, and the replies of
the constrained requests are checked against the schema.

    sluice bench structured [--fractions 0,0.5] [--num-requests N] [engine flags]

Runs on a CPU with the tiny model as a smoke test (`--model` of a tiny folder, few requests).
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

from sluice.bench.throughput import _timed_generate, build_llm
from sluice.bench.workloads import (
    NANO_VLLM_MAX_INPUT_LEN,
    NANO_VLLM_MAX_OUTPUT_LEN,
    NANO_VLLM_NUM_REQUESTS,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "title": {"type": "string"},
        "score": {"type": "number"},
        "done": {"type": "boolean"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "title", "score", "done", "notes"],
}


def add_parser(bench_sub: Any) -> None:
    from sluice.engine.flags import add_engine_args

    parser = bench_sub.add_parser(
        "structured", help="throughput with a share of json_schema requests, against none")
    parser.add_argument("--fractions", default="0,0.5",
                        help="comma-separated shares of json_schema requests (0 is the "
                             "baseline, always run first)")
    parser.add_argument("--num-requests", type=int, default=NANO_VLLM_NUM_REQUESTS)
    parser.add_argument("--max-input-len", type=int, default=NANO_VLLM_MAX_INPUT_LEN)
    parser.add_argument("--max-output-len", type=int, default=NANO_VLLM_MAX_OUTPUT_LEN)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    add_engine_args(parser)
    parser.set_defaults(func=_cmd_structured)


def parse_fractions(text: str) -> list[float]:
    try:
        fractions = sorted({float(f) for f in text.split(",") if f.strip()} | {0.0})
    except ValueError:
        raise ValueError(f"--fractions must be numbers in [0, 1], got {text!r}") from None
    if any(not 0.0 <= f <= 1.0 for f in fractions):
        raise ValueError(f"--fractions must be numbers in [0, 1], got {text!r}")
    return fractions


def constrained_rows(num_requests: int, fraction: float) -> set[int]:
    """Requests spread evenly through the workload (fraction 0.5: every other one)."""
    count = round(num_requests * fraction)
    return {int(i * num_requests / count) for i in range(count)} if count else set()


def run_structured(ns: argparse.Namespace) -> dict[str, Any]:
    import jsonschema  # noqa: F401  (checked below when installed)

    from sluice import SamplingParams, StructuredOutputsParams
    from sluice.bench.record import make_record
    from sluice.bench.workloads import nano_vllm_workload, random_prompts

    fractions = parse_fractions(ns.fractions)
    workload = nano_vllm_workload(ns.num_requests, ns.max_input_len, ns.max_output_len)
    llm, device, dtype = build_llm(ns)
    engine = llm.llm_engine
    hf_config = engine.hf_config
    workload = workload.fold_token_ids(hf_config.vocab_size)
    structured = StructuredOutputsParams(json=SCHEMA)

    def params(max_tokens: int, constrained: bool) -> Any:
        return SamplingParams(temperature=ns.temperature, ignore_eos=True, max_tokens=max_tokens,
                              structured_outputs=structured if constrained else None)

    warmup = random_prompts(4, 32, hf_config.vocab_size, random.Random(1))
    _timed_generate(llm, warmup, [params(8, i % 2 == 0) for i in range(4)], device)
    runs = []
    for fraction in fractions:
        rows = constrained_rows(workload.num_requests, fraction)
        outputs, seconds = _timed_generate(
            llm, workload.prompts,
            [params(m, i in rows) for i, m in enumerate(workload.max_tokens)], device)
        generated = [len(o.outputs[0].token_ids) for o in outputs]
        constrained_outputs = [outputs[i].outputs[0] for i in sorted(rows)]
        runs.append({
            "fraction": fraction,
            "num_constrained": len(rows),
            "seconds": seconds,
            "output_tokens": sum(generated),
            "output_tok_s": sum(generated) / seconds,
            "constrained_output_tokens": sum(len(o.token_ids) for o in constrained_outputs),
            "constrained_ended_early": sum(o.finish_reason == "stop"
                                           for o in constrained_outputs),
            "constrained_valid_prefixes": _check_replies(constrained_outputs),
        })
    llm.shutdown()
    base = runs[0]["output_tok_s"]
    for run in runs:
        run["ratio_vs_unconstrained"] = run["output_tok_s"] / base
    return make_record("structured", {
        "model": engine.model_config.model,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "num_requests": workload.num_requests,
        "prompt_tokens": workload.prompt_tokens,
        "requested_output_tokens": workload.output_tokens,
        "schema": SCHEMA,
        "runs": runs,
    }, device=device, command=getattr(ns, "sluice_argv", None))


def _check_replies(outputs: list[Any]) -> int:
    """Replies that are valid JSON for the schema, or (cut by max_tokens) start like one."""
    import jsonschema

    valid = 0
    for output in outputs:
        if output.finish_reason == "stop":
            jsonschema.validate(json.loads(output.text), SCHEMA)
        elif not output.text.lstrip().startswith("{"):
            raise AssertionError(f"a constrained reply does not start a JSON object: "
                                 f"{output.text[:80]!r}")
        valid += 1
    return valid


def format_structured(record: dict[str, Any]) -> str:
    from sluice.bench.record import command_text, describe_machine

    results = record["results"]
    lines = [
        f"command: {command_text(record)}",
        f"machine: {describe_machine(record['machine'])}",
        f"model: {results['model']} ({results['dtype']}, {results['device']})",
        f"workload: {results['num_requests']} requests, {results['prompt_tokens']:,} prompt "
        f"tokens, up to {results['requested_output_tokens']:,} output tokens",
    ]
    for run in results["runs"]:
        lines.append(
            f"{100 * run['fraction']:.0f}% json_schema ({run['num_constrained']} requests, "
            f"{run['constrained_ended_early']} ended by their grammar): {run['seconds']:.2f} s, "
            f"{run['output_tokens']:,} output tokens, {run['output_tok_s']:,.0f} output tok/s, "
            f"{run['ratio_vs_unconstrained']:.3f}x of 0%")
    return "\n".join(lines)


def _cmd_structured(ns: argparse.Namespace) -> int:
    from sluice.bench.record import write_record

    record = run_structured(ns)
    print(format_structured(record))
    if ns.output:
        write_record(ns.output, record)
    return 0
