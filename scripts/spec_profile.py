"""Host profile of greedy generation with n-gram speculation (cProfile, top functions by
cumulative time). PYTHONPATH=. python scripts/spec_profile.py [BATCH] [OUT]"""

import cProfile
import io
import pstats
import random
import sys

from sluice import LLM, SamplingParams
from sluice.bench.spec_decode import make_prompts
from sluice.bench.workloads import benchmark_model_dir, cache_root

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 32
llm = LLM(model=str(benchmark_model_dir(cache_root({}))),
          speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                              "prompt_lookup_max": 4, "prompt_lookup_min": 2})
prompts = make_prompts("repeat", batch, 512, 64, llm.llm_engine.hf_config.vocab_size,
                       random.Random(0))
params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
requests = [{"prompt_token_ids": p} for p in prompts]
llm.generate(requests, params, use_tqdm=False)
profiler = cProfile.Profile()
profiler.enable()
llm.generate(requests, params, use_tqdm=False)
profiler.disable()
out = io.StringIO()
pstats.Stats(profiler, stream=out).sort_stats("cumtime").print_stats(45)
pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
print(out.getvalue())
