"""Where a lone prompt's step time goes on the device timeline: `LLM.generate(max_tokens=1)` of
one random prompt per length under torch.profiler (CPU and CUDA activity), after warm-ups. Per
length: the span from the first GPU activity to the last, the GPU's busy time (the union of its
kernels and copies), the idle gaps of more than 20 us with the activities on either side, the
host calls that launch work (cudaGraphLaunch, cudaMemcpyAsync, ...) with their host time, and
the kernel time by name. CUDA only.

    PYTHONPATH=. python benchmarks/tools/prefill_trace.py MODEL_DIR OUT_JSON 1024,3000 \
        [TRACE.json.gz]
"""

from __future__ import annotations

import collections
import gzip
import json
import random
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from sluice import LLM, SamplingParams


def _summary(events: list[dict]) -> dict:
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    if not gpu:
        return {"error": "no GPU activity"}
    start, end = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    busy, cursor, gaps = 0.0, start, []
    previous = None
    for e in gpu:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s > cursor:
            if s - cursor > 20 and previous is not None:
                gaps.append({"us": round(s - cursor, 1), "at_us": round(cursor - start, 1),
                             "after": previous["name"][:90], "before": e["name"][:90]})
        if f > cursor:
            busy += f - max(s, cursor)
            cursor = f
            previous = e
    by_name: dict[str, float] = collections.defaultdict(float)
    for e in gpu:
        by_name[e["name"][:100]] += e["dur"]
    calls: dict[str, list[float]] = collections.defaultdict(list)
    for e in runtime:
        calls[e["name"]].append(e["dur"])
    first_launch = min((e["ts"] for e in runtime), default=start)
    return {
        "gpu_span_us": round(end - start, 1),
        "gpu_busy_us": round(busy, 1),
        "idle_us": round(end - start - busy, 1),
        "first_runtime_call_to_first_gpu_us": round(start - first_launch, 1),
        "gaps_over_20us": sorted(gaps, key=lambda g: -g["us"])[:25],
        "gap_count": len(gaps),
        "gap_total_us": round(sum(g["us"] for g in gaps), 1),
        "runtime_calls": {k: {"n": len(v), "host_us": round(sum(v), 1)}
                          for k, v in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:12]},
        "kernels_top": [{"name": k, "us": round(v, 1)}
                        for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:30]],
        "kernel_count": len(gpu),
    }


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    lens = [int(x) for x in sys.argv[3].split(",")]
    trace_out = sys.argv[4] if len(sys.argv) > 4 else None
    # 4,096 as shared/peer's lat_peer.py: a max_model_len just above the prompt can leave its
    # padded bucket out of the dense-prefill graphs (an eager, paged-attention step)
    llm = LLM(model=path, dtype="bfloat16", max_model_len=max(4096, max(lens) + 64), seed=0)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)

    def one(n: int) -> None:
        llm.generate([{"prompt_token_ids": [rng.randint(0, 10000) for _ in range(n)]}], params,
                     use_tqdm=False)

    result: dict = {"model": path}
    for n in lens:
        for _ in range(3):
            one(n)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one(n)
            torch.cuda.synchronize()
        name = f"/tmp/prefill-trace-{n}.json"
        prof.export_chrome_trace(name)
        with open(name) as f:
            events = json.load(f)["traceEvents"]
        result[str(n)] = _summary([e for e in events if e.get("ph") == "X"])
        print(n, json.dumps({k: v for k, v in result[str(n)].items()
                             if k not in ("kernels_top", "gaps_over_20us")}), flush=True)
        print("  gaps:", result[str(n)]["gaps_over_20us"][:8], flush=True)
        if trace_out and n == lens[-1]:
            with open(name, "rb") as src, gzip.open(trace_out, "wb") as dst:
                dst.write(src.read())
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
