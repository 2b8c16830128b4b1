"""On a GPU: after start-up, no Triton kernel is compiled in a request's step, whatever the
request asks of the sampler and whether speculation drafts (a compile stalls every request
running with it: 0.24 to 0.7 s on an H200,
`benchmarks/results/latency/2026-11-28-first-use-stalls-h200.json`). Each
launch of an engine warms these paths up (Sampler.warm_up, RejectionSampler.warm_up,
DeviceNgram.warm_up). Skipped without CUDA (the CPU runs no Triton kernel in an engine)."""

from __future__ import annotations

import pytest
import torch

from sluice import LLM, SamplingParams

pytestmark = [pytest.mark.serial,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FEATURES = {
    "temperature": dict(temperature=0.8),
    "seed": dict(temperature=0.8, seed=7),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k": dict(temperature=0.8, top_k=5),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "penalties": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.2,
                      repetition_penalty=1.2),
    "logprobs": dict(temperature=0.0, logprobs=3),
    "logit_bias": dict(temperature=0.0, logit_bias={5: 3.0}),
    "logit_bias_random": dict(temperature=0.8, logit_bias={5: 3.0}),
    "min_tokens": dict(temperature=0.0, min_tokens=8),
}


class Compiles:
    """Triton's JIT hooks while in the block: the kernel variants built."""

    def __enter__(self) -> list[str]:
        from triton import knobs

        self.built: list[str] = []
        knobs.runtime.jit_post_compile_hook = lambda **kw: self.built.append(kw["repr"]) and False
        return self.built

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = None


def _run(llm: LLM, prompt: list[int], max_tokens: int = 24, **params: object) -> None:
    llm.generate([{"prompt_token_ids": prompt}],
                 SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                 use_tqdm=False)


def test_no_sampling_feature_compiles_a_kernel_mid_run():
    llm = LLM(max_model_len=1024, gpu_memory_utilization=0.3)
    try:
        prompt = list(range(10, 60))
        _run(llm, prompt, temperature=0.0)
        for name, params in FEATURES.items():
            with Compiles() as built:
                _run(llm, prompt, **params)
            assert not built, (name, built)
    finally:
        llm.shutdown()


def test_the_first_verification_compiles_no_kernel():
    """N-gram drafts on the device, drafting always on: the first run is a prompt step alone
    (no decode, no verification); in the second a prompt that repeats itself drafts from the
    first decode step, after the prompt's plain step (the step in flight emitted one token)."""
    llm = LLM(max_model_len=1024, gpu_memory_utilization=0.3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "disable_by_batch_size": None,
                                  "min_accepted_tokens_per_step": 0})
    try:
        _run(llm, list(range(10, 40)), max_tokens=1, temperature=0.0)
        before = llm.get_spec_decoding_stats().num_drafts
        with Compiles() as built:
            _run(llm, list(range(100, 116)) * 4, temperature=0.0)
        assert llm.get_spec_decoding_stats().num_drafts > before
        assert not built, built
    finally:
        llm.shutdown()
