"""shared/peer's offline and latency figures from one engine start (one engine per process):
the nano-vllm workload (`bench_peer.py`: a tiny warm-up, then timed runs; the first is the
headline), then `lat_peer.py`'s figures (decode ITL at batch 1 and 64 from 128-token prompts,
TTFT of one 1,024- and one 3,000-token prompt; medians of 5 over fresh random prompts). Saves an
engine start (vLLM: ~95 s) per model when both are wanted. Either engine reads the folder's
quantization_config itself.

    PEER_DIR=../shared/peer python benchmarks/tools/peer_all.py --engine sluice|vllm --model DIR \
        [--arch qwen3-8b] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.environ.get("PEER_DIR", os.path.join(os.path.dirname(__file__), "..", "..",
                                                          "..", "shared", "peer")))
from workload import ARCHS, nano_vllm_workload, roofline  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True, choices=["sluice", "vllm"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--arch", default="qwen3-8b",
                    help=f"{'|'.join(sorted(ARCHS))}: the roofline's; another name skips it")
    ap.add_argument("--out")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    if a.engine == "vllm":
        import vllm
        from vllm import LLM, SamplingParams
        version = vllm.__version__
    else:
        import sluice
        from sluice import LLM, SamplingParams
        version = getattr(sluice, "__version__", "?")
    t_init = time.perf_counter()
    # PEER_LLM_KWARGS: more engine arguments as JSON (e.g. vLLM's {"linear_backend": "triton"})
    extra = json.loads(os.environ.get("PEER_LLM_KWARGS") or "{}")
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=4096, seed=0, **extra)
    init_s = time.perf_counter() - t_init
    prompts, max_tokens = nano_vllm_workload()
    llm.generate(["t1 t2 t3"], SamplingParams(max_tokens=8))
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    runs = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"tokens": n, "seconds": round(dt, 3), "tok_s": round(n / dt, 1)})
    rl = (roofline(prompts, max_tokens, cfg=ARCHS[a.arch])["roofline_tok_s"]
          if a.arch in ARCHS else None)
    rng = random.Random(0)

    def timed(lengths, n_out, reps=5):
        sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n_out)
        ts = []
        for _ in range(reps + 1):
            ps = [{"prompt_token_ids": [rng.randint(0, 10000) for _ in range(n)]} for n in lengths]
            t0 = time.perf_counter()
            llm.generate(ps, sp, use_tqdm=False)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:])

    lat = {}
    for b in (1, 64):
        t1, t128 = timed([128] * b, 1), timed([128] * b, 128)
        lat[f"itl_b{b}_ms"] = round((t128 - t1) / 127 * 1e3, 3)
    lat["ttft_1k_ms"] = round(timed([1024], 1) * 1e3, 2)
    lat["ttft_3k_ms"] = round(timed([3000], 1) * 1e3, 2)
    import torch
    res = {"engine": a.engine, "model": a.model, "version": version, "engine_kwargs": extra,
           "gpu": torch.cuda.get_device_name(), "init_s": round(init_s, 1),
           "offline": {"expected_tokens": sum(max_tokens), "runs": runs,
                       "first_run_tok_s": runs[0]["tok_s"], "roofline_tok_s": rl and round(rl)},
           "latency": lat}
    print(json.dumps(res), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
