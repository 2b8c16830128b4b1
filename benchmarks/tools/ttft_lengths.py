"""Time to first token of long prompts of lengths the engine has not seen, and of the same
lengths again: whether a step of a new shape pays for planning its kernels (cuDNN builds an
execution plan for each new attention shape). Also the engine's start-up time. CUDA only.

    python benchmarks/tools/ttft_lengths.py OUT.json [--lengths 19000,21000,23000,27000,30000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from sluice import LLM, SamplingParams
from sluice.bench.record import make_record, write_record
from sluice.bench.workloads import benchmark_model_dir, cache_root, random_prompts


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--lengths", default="19000,21000,23000,27000,30000")
    ns = parser.parse_args(argv)
    lengths = [int(n) for n in ns.lengths.split(",")]
    start = time.perf_counter()
    llm = LLM(model=benchmark_model_dir(cache_root(dict(os.environ))))
    startup_s = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    # Two prompts a length, drawn beforehand: the first of a length meets its shapes first.
    prompts = {n: random_prompts(2, n, 151936, rng) for n in lengths}
    llm.generate([{"prompt_token_ids": random_prompts(1, 1024, 151936, rng)[0]}], params,
                 use_tqdm=False)
    record: dict = {"startup_s": round(startup_s, 2), "ttft_ms": {}}
    for n in lengths:
        times = []
        for prompt in prompts[n]:
            torch.cuda.synchronize()
            begin = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            times.append(round((time.perf_counter() - begin) * 1e3, 2))
        record["ttft_ms"][n] = {"first_of_length": times[0], "second": times[1]}
        print(f"{n:>7} tokens: first of its length {times[0]:8.2f} ms, again {times[1]:8.2f} ms",
              flush=True)
    print(f"start-up {startup_s:.2f} s")
    write_record(ns.output, make_record("ttft-lengths", record, device="cuda",
                                        command=["python", sys.argv[0], *argv]))


if __name__ == "__main__":
    main(sys.argv[1:])
