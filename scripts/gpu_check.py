"""GPU check: greedy ids on CUDA (float32) equal the CPU reference for tiny Qwen3 / Llama / Qwen2
models, with and without prefix caching and with small prefill chunks; then a smoke run of the
benchmark model (the Qwen3-0.6B architecture, random bf16 weights).

    PYTHONPATH=. python scripts/gpu_check.py [OUT_DIR]

Writes gpu_check.json into OUT_DIR (default: benchmarks/).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

import torch

from sluice import LLM, SamplingParams
from sluice.model.tiny import make_tiny_model


def greedy_ids(llm: LLM, prompts: list[dict], max_tokens: int = 32) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "benchmarks"
    work = tempfile.mkdtemp()
    result: dict[str, object] = {"gpu": torch.cuda.get_device_name(0),
                                 "torch": torch.__version__}
    rng = random.Random(0)
    for arch in ("qwen3", "llama", "qwen2"):
        model = make_tiny_model(os.path.join(work, arch), arch=arch)
        prompts = [{"prompt_token_ids": [rng.randrange(3, 600) for _ in range(n)]}
                   for n in (5, 40, 130, 17)]
        reference = greedy_ids(LLM(model=model, dtype="float32", device="cpu",
                                   max_num_batched_tokens=64), prompts)
        for name, kwargs in (("default", {}), ("no_prefix_caching",
                                               {"enable_prefix_caching": False}),
                             ("chunks_of_32", {"max_num_batched_tokens": 32})):
            llm = LLM(model=model, dtype="float32", device="cuda", **kwargs)
            result[f"{arch}_{name}_equals_cpu"] = greedy_ids(llm, prompts) == reference
    print(json.dumps(result, indent=1), flush=True)

    model = make_tiny_model(os.path.join(work, "qwen3-0.6b"), preset="qwen3-0.6b")
    llm = LLM(model=model, max_model_len=4096)
    prompts = [{"prompt_token_ids": [rng.randrange(0, 10000)
                                     for _ in range(rng.randrange(100, 1024))]}
               for _ in range(32)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=256),
                 use_tqdm=False)
    result["qwen3_0.6b_32_requests_x_256_tokens_output_tok_s"] = 32 * 256 / (
        time.perf_counter() - start)
    print(json.dumps(result, indent=1))
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
