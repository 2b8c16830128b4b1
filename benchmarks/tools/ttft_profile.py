"""Where a lone prompt's time to first token goes on the host: `LLM.generate` of one prompt of
`--prompt-len` random ids to one token, as `sluice bench latency` times TTFT, repeated; the wall
time per call, and cProfile's top functions by own and by cumulative time over as many more
calls. CUDA only.

    python benchmarks/tools/ttft_profile.py OUT.json [--prompt-len 1024] [--calls 30]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time

import torch

from sluice import LLM, SamplingParams
from sluice.bench.record import make_record, write_record
from sluice.bench.workloads import benchmark_model_dir, cache_root, random_prompts


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=30)
    ns = parser.parse_args(argv)
    llm = LLM(model=benchmark_model_dir(cache_root(dict(os.environ))))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # Drawn beforehand: 1,024 randint calls take about 1 ms, which the timing must not hold.
    prompts = iter(random_prompts(5 + 2 * ns.calls, ns.prompt_len, 151936, random.Random(0)))

    def one() -> None:
        llm.generate([{"prompt_token_ids": next(prompts)}], params, use_tqdm=False)

    for _ in range(5):
        one()
    walls = []
    for _ in range(ns.calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        one()
        walls.append((time.perf_counter() - start) * 1e3)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(ns.calls):
        one()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{os.path.relpath(file) if file.startswith('/') else file}"
                                 f":{line}({name})", "calls_per_generate": ncalls / ns.calls,
                     "own_ms": tottime / ns.calls * 1e3, "cumulative_ms": cumtime / ns.calls * 1e3})
    by_own = sorted(rows, key=lambda r: -r["own_ms"])[:40]
    by_cum = sorted(rows, key=lambda r: -r["cumulative_ms"])[:60]
    report = {"ttft_ms_median": statistics.median(walls),
              "ttft_ms": walls, "by_own_time": by_own, "by_cumulative_time": by_cum}
    print(f"median TTFT {report['ttft_ms_median']:.3f} ms over {ns.calls} calls")
    for row in by_cum:
        print(f"{row['cumulative_ms']:8.3f} {row['own_ms']:8.3f} {row['calls_per_generate']:6.1f} "
              f"{row['function']}")
    print("--- by own time")
    for row in by_own[:25]:
        print(f"{row['cumulative_ms']:8.3f} {row['own_ms']:8.3f} {row['calls_per_generate']:6.1f} "
              f"{row['function']}")
    write_record(ns.output, make_record("ttft-profile", report, device="cuda",
                                        command=["python", sys.argv[0], *argv]))
    llm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
