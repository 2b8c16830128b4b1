"""How much of the random Qwen3-0.6B's greedy output n-gram drafting would get right, per prompt
of the `repeat` workload, with the layers' norms folded into the projections (the default on
CUDA) and without: was the fall of batch-1 acceptance from 50% to 14% after the folding (issue
20) a property of the folding, or of the one sequence a batch-1 run follows?

Each prompt is generated alone (batch 1, greedy, bf16, speculation off), then drafting is replayed
over prompt + output as the n-gram proposer does it with drafting always on (k = 4, n-grams of 2
to 4; a step verifies its draft, keeps the accepted tokens and the next one). Greedy output is
the same with speculation as without, so this is the acceptance a speculative run would see.

    PYTHONPATH=. python scripts/ngram_acceptance.py OUT_DIR [NUM_PROMPTS]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys

import numpy as np
import torch

from sluice import LLM, SamplingParams
from sluice.bench.spec_decode import make_prompts
from sluice.bench.workloads import benchmark_model_dir, cache_root
from sluice.model.models.llama import LlamaModel
from sluice.spec_decode.ngram_proposer import find_longest_ngram_match

K, MIN_N, MAX_N = 4, 2, 4


def replay_drafting(prompt: list[int], output: list[int]) -> dict[str, float]:
    """Steps, drafted and accepted tokens of n-gram drafting over `output` after `prompt`."""
    tokens = prompt + output
    done = len(prompt) + 1  # the first output token comes from the prefill
    steps = drafted = accepted = drafting_steps = 0
    while done < len(tokens):
        steps += 1
        match = find_longest_ngram_match(np.asarray(tokens[:done]), MIN_N, MAX_N)
        draft = [] if match is None else tokens[match[1]:match[1] + K][:len(tokens) - done]
        good = 0
        for proposed, actual in zip(draft, tokens[done:]):
            if proposed != actual:
                break
            good += 1
        drafting_steps += bool(draft)
        drafted += len(draft)
        accepted += good
        done += good + 1
    return {"steps": steps, "drafting_steps": drafting_steps, "drafted": drafted,
            "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_step": (len(output) - 1) / steps if steps else 0.0}


def main() -> None:
    out_dir = sys.argv[1]
    num_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    model = benchmark_model_dir(cache_root(dict(os.environ)))
    result: dict[str, object] = {
        "command": "PYTHONPATH=. python scripts/ngram_acceptance.py " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(0), "k": K, "ngram": [MIN_N, MAX_N]}
    fold = LlamaModel.fold_norms
    for folded in (True, False):
        if not folded:
            LlamaModel.fold_norms = lambda self, above_tokens: False
        llm = LLM(model=model, gpu_memory_utilization=0.4)
        prompts = make_prompts("repeat", num_prompts, 512, 64,
                               llm.llm_engine.hf_config.vocab_size, random.Random(0))
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
        rows = []
        for prompt in prompts:
            output = llm.generate([{"prompt_token_ids": prompt}], params,
                                  use_tqdm=False)[0].outputs[0].token_ids
            rows.append(replay_drafting(prompt, list(output)) | {"output_head": output[:8]})
        acceptance = [r["acceptance"] for r in rows]
        result["folded" if folded else "not_folded"] = {
            "per_prompt": rows,
            "acceptance_median": statistics.median(acceptance),
            "acceptance_min": min(acceptance), "acceptance_max": max(acceptance),
            "tokens_per_step_median": statistics.median(r["tokens_per_step"] for r in rows)}
        print("folded" if folded else "not folded",
              [round(a, 2) for a in acceptance], flush=True)
        llm.shutdown()
        LlamaModel.fold_norms = fold
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ngram-acceptance.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
