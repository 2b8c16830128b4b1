import time, random, sys
import torch
from sluice import LLM, SamplingParams
from sluice.bench.workloads import benchmark_model_dir, cache_root
import os
d = benchmark_model_dir(cache_root(dict(os.environ)))
llm = LLM(model=d, kv_offloading_size=4, max_model_len=20000)
eng = llm.llm_engine
rng = random.Random(0)
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
def gen(p):
    torch.cuda.synchronize(); t = time.perf_counter()
    o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
    torch.cuda.synchronize(); return (time.perf_counter() - t) * 1e3, o.num_cached_tokens
for L in (2048, 8192):
    for it in range(3):
        p = [rng.randrange(100, 100000) for _ in range(L)]
        a = gen(p); b = gen(p); eng.kv_cache_manager.reset_prefix_cache(); c = gen(p)
        print(L, "recompute", a, "gpu", b, "cpu", c, flush=True)
# step timing for a cpu hit
core = eng.engine_core
orig = core.step
times = []
def timed():
    t = time.perf_counter(); r = orig(); torch.cuda.synchronize(); times.append((time.perf_counter() - t) * 1e3); return r
core.step = timed
p = [rng.randrange(100, 100000) for _ in range(2048)]
gen(p); eng.kv_cache_manager.reset_prefix_cache(); times.clear()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    print("cpu hit", gen(p))
print("steps ms", times)
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
