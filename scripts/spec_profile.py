"""Host profile of greedy generation with n-gram speculation (cProfile, top functions by
cumulative and by own time), on the `repeat` workload of `sluice bench spec`.

    PYTHONPATH=. python scripts/spec_profile.py [BATCH] [SPECULATIVE_CONFIG | none]

The default config drafts whatever the batch size and acceptance (the policy out of the way);
`none` profiles the same generation without speculation, the baseline."""

import cProfile
import io
import json
import pstats
import random
import sys
import time

from sluice import LLM, SamplingParams
from sluice.bench.spec_decode import make_prompts
from sluice.bench.workloads import benchmark_model_dir, cache_root

ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
          "prompt_lookup_min": 2, "disable_by_batch_size": None,
          "min_accepted_tokens_per_step": 0}
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 32
spec = json.loads(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "none" else (
    None if len(sys.argv) > 2 else ALWAYS)
llm = LLM(model=str(benchmark_model_dir(cache_root({}))), speculative_config=spec)
prompts = make_prompts("repeat", batch, 512, 64, llm.llm_engine.hf_config.vocab_size,
                       random.Random(0))
params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
requests = [{"prompt_token_ids": p} for p in prompts]
llm.generate(requests, params, use_tqdm=False)
start = time.perf_counter()
llm.generate(requests, params, use_tqdm=False)
print(f"speculative config {spec}: batch {batch}, {time.perf_counter() - start:.3f} s unprofiled")
if spec is not None:
    print(llm.get_spec_decoding_stats())
profiler = cProfile.Profile()
profiler.enable()
llm.generate(requests, params, use_tqdm=False)
profiler.disable()
out = io.StringIO()
pstats.Stats(profiler, stream=out).sort_stats("cumtime").print_stats(40)
pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
print(out.getvalue())
