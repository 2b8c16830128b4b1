"""The baseline: Hugging Face transformers' own continuous batching on the same workload.

Configured as the H200 figure in BENCHMARKS.md was measured: the model with
`attn_implementation="sdpa"` (paged by the manager), `GenerationConfig(do_sample=True,
temperature=0.6, eos_token_id=-1)`, `ContinuousBatchingConfig(block_size=256,
max_batch_tokens=16384, use_cuda_graph=True)`; `init_continuous_batching`, `start`, one
`add_request` per prompt, `get_result` until all have finished; a small warm-up run first.
Transformers without continuous batching (before 5.x) gives a result saying so, not an error.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from sluice.bench.workloads import random_prompts

PAGE_SIZE = 256
MAX_BATCH_TOKENS = 16384
_WARMUP_REQUESTS, _WARMUP_PROMPT_LEN, _WARMUP_MAX_TOKENS = 4, 32, 8


@dataclass(frozen=True, slots=True)
class HFBaselineResult:
    transformers_version: str
    unavailable_reason: str | None = None  # None: it ran
    output_tokens: int = 0
    seconds: float = 0.0
    attn_implementation: str = ""  # the implementation the manager ran with

    @property
    def output_tok_s(self) -> float | None:
        if self.unavailable_reason is not None or self.seconds <= 0:
            return None
        return self.output_tokens / self.seconds


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def unavailable_reason() -> str | None:
    """Why continuous batching cannot run with the installed transformers, or None."""
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
        from transformers.generation import GenerationMixin
    except ImportError as e:
        return (f"transformers {_transformers_version()} has no continuous batching API "
                f"({e}); it needs transformers 5")
    if not hasattr(GenerationMixin, "init_continuous_batching"):
        return (f"transformers {_transformers_version()} continuous batching has no "
                "init_continuous_batching()")
    return None


def continuous_batching_config(use_cuda_graph: bool = True, **overrides: Any) -> Any:
    from transformers import ContinuousBatchingConfig

    names = {f.name for f in fields(ContinuousBatchingConfig)}
    # Renamed block_size -> page_size in 5.17; the same thing, tokens per cache page.
    page_key = "page_size" if "page_size" in names else "block_size"
    kwargs = {page_key: PAGE_SIZE, "max_batch_tokens": MAX_BATCH_TOKENS,
              "use_cuda_graph": use_cuda_graph, **overrides}
    return ContinuousBatchingConfig(**kwargs)


def build_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The model folder's weights in transformers, with SDPA attention, on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 attn_implementation="sdpa")
    return model.to(device).eval()


def _run_batch(manager: Any, prompts: Sequence[list[int]], max_tokens: Sequence[int],
               prefix: str, timeout_s: float) -> int:
    """Add every request, wait for all to finish; returns the number of generated tokens."""
    pending = set()
    for i, (prompt, num_tokens) in enumerate(zip(prompts, max_tokens)):
        request_id = f"{prefix}{i}"
        manager.add_request(list(prompt), request_id=request_id, max_new_tokens=num_tokens)
        pending.add(request_id)
    generated = 0
    deadline = time.monotonic() + timeout_s
    while pending:
        result = manager.get_result(timeout=1.0)
        if result is None:
            status = getattr(manager, "background_thread_status", None)
            error = getattr(status, "fatal_error", None)
            running = getattr(manager, "is_running", lambda: True)()
            if error is not None or not running:
                raise RuntimeError(f"transformers continuous batching stopped with "
                                   f"{len(pending)} requests pending: {error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"transformers continuous batching timed out after "
                                   f"{timeout_s:.0f} s with {len(pending)} requests pending")
            continue
        if not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"transformers request {result.request_id} failed: "
                               f"{result.error}")
        pending.discard(result.request_id)
        generated += len(result.generated_tokens)
    return generated


def run_hf_baseline(model: Any, prompts: Sequence[list[int]], max_tokens: Sequence[int],
                    temperature: float = 0.6, timeout_s: float = 3600.0,
                    **cb_overrides: Any) -> HFBaselineResult:
    """Time transformers' continuous batching on the workload (after a small warm-up)."""
    version = _transformers_version()
    reason = unavailable_reason()
    if reason is not None:
        return HFBaselineResult(version, unavailable_reason=reason)
    from transformers import GenerationConfig

    generation_config = GenerationConfig(do_sample=True, temperature=temperature,
                                         eos_token_id=-1)
    manager = model.init_continuous_batching(
        generation_config=generation_config,
        continuous_batching_config=continuous_batching_config(**cb_overrides))
    device = model.device
    if device.type == "cuda" and hasattr(manager, "warmup"):
        # Pre-captures the CUDA graphs at their largest sizes, as generate_batch does; there
        # are no graphs on the CPU, where this only costs time.
        manager.warmup()
    manager.start()
    try:
        attn_implementation = str(model.config._attn_implementation)
        warmup = random_prompts(_WARMUP_REQUESTS, _WARMUP_PROMPT_LEN,
                                model.config.vocab_size, random.Random(1))
        _run_batch(manager, warmup, [_WARMUP_MAX_TOKENS] * len(warmup), "warmup-", timeout_s)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        generated = _run_batch(manager, prompts, max_tokens, "bench-", timeout_s)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
        if hasattr(manager, "destroy"):
            manager.destroy()
    return HFBaselineResult(version, output_tokens=generated, seconds=seconds,
                            attn_implementation=attn_implementation)


def measure_hf_baseline(model_dir: str, prompts: Sequence[list[int]],
                        max_tokens: Sequence[int], dtype: torch.dtype, device: torch.device,
                        temperature: float = 0.6, **cb_overrides: Any) -> HFBaselineResult:
    """Build the model from `model_dir`, run the baseline, free the device memory again.

    `cb_overrides` replace ContinuousBatchingConfig fields (tests on the CPU shrink the cache).
    """
    reason = unavailable_reason()
    if reason is not None:
        return HFBaselineResult(_transformers_version(), unavailable_reason=reason)
    model = build_hf_model(model_dir, dtype, device)
    try:
        return run_hf_baseline(model, prompts, max_tokens, temperature, **cb_overrides)
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
