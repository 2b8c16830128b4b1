"""The first use of each sampling feature after start-up against its second: one request of 128
prompt tokens and 32 generated ones through LLM.generate, after a greedy warm-up generation,
with the Triton variants built during the first (a stall here stalls every running request).

    PYTHONPATH=. python benchmarks/tools/first_use_stalls.py [MODEL]

MODEL: a model folder (default: the benchmark model, random Qwen3-0.6B). On a GPU."""

import sys
import time

import torch

from sluice import LLM, SamplingParams, StructuredOutputsParams
from sluice.bench.profile_steps import _JitWatch
from sluice.bench.workloads import benchmark_model_dir, cache_root

CASES = {
    "temperature 0.8": dict(temperature=0.8),
    "seed": dict(temperature=0.8, seed=7),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "top_k 20": dict(temperature=0.8, top_k=20),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "presence_penalty": dict(temperature=0.8, presence_penalty=0.5),
    "repetition_penalty": dict(temperature=0.0, repetition_penalty=1.2),
    "frequency_penalty": dict(temperature=0.0, frequency_penalty=0.3),
    "logprobs 5": dict(temperature=0.0, logprobs=5),
    "prompt_logprobs 2": dict(temperature=0.0, prompt_logprobs=2),
    "logit_bias": dict(temperature=0.0, logit_bias={5: 3.0}),
    "min_tokens": dict(temperature=0.0, min_tokens=8),
    "n 2": dict(temperature=0.8, n=2),
    "regex": dict(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[a-z]+")),
    "regex, another grammar": dict(temperature=0.0,
                                   structured_outputs=StructuredOutputsParams(regex="[0-9]+")),
}


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(benchmark_model_dir(cache_root({})))
    llm = LLM(model=model, max_model_len=4096)
    prompt = [{"prompt_token_ids": list(range(1000, 1128))}]
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                 use_tqdm=False)
    for name, params in CASES.items():
        times, built = [], []
        for _ in range(2):
            watch = _JitWatch()
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True, **params),
                         use_tqdm=False)
            torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - start))
            watch.stop()
            built.append([(r["kernel"][:60], r["seconds"]) for r in watch.records])
        print(f"{name:24s} first {times[0]:8.1f} ms  second {times[1]:8.1f} ms  "
              f"compiled in the first {built[0]}", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
