"""How close dense prefill attention (cuDNN) keeps a bfloat16 model to float32, against the paged
Triton kernel it replaces, on the benchmark model (Qwen3-0.6B architecture, random weights).

    python benchmarks/tools/dense_prefill_check.py OUT.json [--prompt-lens 200,1000,4000,8000]

Lone fresh prompts of random ids (past 8,192 tokens in chunks: the later ones over a cached
prefix) run through three engines, one after the other: float32 (paged
attention: dense prefill is offered only for 16-bit dtypes), bfloat16 with dense prefill (the
default), and bfloat16 with it turned off. For each prompt it prints the mean and largest
|logprob difference| of the prompt's own tokens from float32's (every position of the prompt
step, so every row of the dense attention counts), and whether the 16 greedy tokens after it
equal float32's. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from sluice import LLM, SamplingParams
from sluice.bench.record import make_record, write_record
from sluice.bench.workloads import benchmark_model_dir, cache_root, random_prompts


def run(model: str, dtype: str, prompts: list[list[int]], dense: bool) -> list[dict]:
    llm = LLM(model=model, dtype=dtype, max_model_len=max(len(p) for p in prompts) + 64,
              gpu_memory_utilization=0.4, enable_prefix_caching=False, dense_prefill=dense)
    runner = llm.llm_engine.engine_core.executor.model_runner
    dense_graphs = runner.graph_runner.dense_prefill_graphs is not None
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=0, ignore_eos=True)
    results = []
    for prompt in prompts:  # one at a time: each step is one fresh prompt
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        logprobs = [entry[token].logprob for entry, token in
                    zip(out.prompt_logprobs[1:], prompt[1:])]
        results.append({"logprobs": logprobs, "tokens": out.outputs[0].token_ids,
                        "dense_graphs": dense_graphs})
    llm.shutdown()
    return results


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--prompt-lens", default="200,1000,4000,8000")
    ns = parser.parse_args(argv)
    import os

    model = benchmark_model_dir(cache_root(dict(os.environ)))
    lens = [int(x) for x in ns.prompt_lens.split(",")]
    rng = random.Random(0)
    prompts = [random_prompts(1, n, 151936, rng)[0] for n in lens]
    ref = run(model, "float32", prompts, dense=False)
    runs = {"bf16_dense": run(model, "bfloat16", prompts, dense=True),
            "bf16_paged": run(model, "bfloat16", prompts, dense=False)}
    report = {"cudnn": torch.backends.cudnn.version(), "prompts": []}
    for i, n in enumerate(lens):
        row = {"prompt_len": n}
        for name, results in runs.items():
            diffs = [abs(a - b) for a, b in zip(results[i]["logprobs"], ref[i]["logprobs"])]
            row[name] = {"mean_abs_logprob_diff": sum(diffs) / len(diffs),
                         "max_abs_logprob_diff": max(diffs),
                         "greedy_equals_fp32": results[i]["tokens"] == ref[i]["tokens"],
                         "dense_graphs": results[i]["dense_graphs"]}
        row["bf16_dense_greedy_equals_paged"] = (runs["bf16_dense"][i]["tokens"]
                                                 == runs["bf16_paged"][i]["tokens"])
        report["prompts"].append(row)
        print(json.dumps(row), flush=True)
    write_record(ns.output, make_record("dense-prefill-check", report, device="cuda",
                                        command=["python", sys.argv[0], *argv]))


if __name__ == "__main__":
    main(sys.argv[1:])
