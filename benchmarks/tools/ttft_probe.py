"""Where a lone prompt's TTFT goes: per `LLM.generate(max_tokens=1)`, the wall time, the host time
until the step's launch, the host time of the launch call, and the device time of the step (CUDA
events around the launch); medians of 5 after a warm-up. CUDA only.

    PYTHONPATH=. python benchmarks/tools/ttft_probe.py MODEL_DIR OUT_JSON 1024,3000,8192
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import torch

from sluice import LLM, SamplingParams
from sluice.worker import model_runner


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    lens = [int(x) for x in sys.argv[3].split(",")]
    llm = LLM(model=path, dtype="bfloat16", max_model_len=max(lens) + 64, seed=0)
    marks: dict = {}
    launch_step = model_runner.ModelRunner.launch

    def launch(self, *args, **kwargs):
        marks["launch_host"] = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        handle = launch_step(self, *args, **kwargs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        marks["launch_ret"] = time.perf_counter()
        marks["events"] = (start, end)
        return handle

    model_runner.ModelRunner.launch = launch
    rng = random.Random(0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    result = {}
    for n in lens:
        rows = []
        for _ in range(6):
            prompts = [{"prompt_token_ids": [rng.randint(0, 10000) for _ in range(n)]}]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            t1 = time.perf_counter()
            start, end = marks["events"]
            end.synchronize()
            rows.append({"wall_ms": (t1 - t0) * 1e3,
                         "host_before_launch_ms": (marks["launch_host"] - t0) * 1e3,
                         "launch_call_ms": (marks["launch_ret"] - marks["launch_host"]) * 1e3,
                         "device_ms": start.elapsed_time(end)})
        result[n] = {k: round(statistics.median(r[k] for r in rows[1:]), 3) for k in rows[0]}
        print(n, result[n], flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
