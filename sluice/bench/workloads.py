"""Offline benchmark workloads and the benchmark model.

The default workload is nano-vllm's `bench.py`, regenerated exactly: with `seed(0)`, 256 prompts
of `randint(100, 1024)` ids drawn by `randint(0, 10000)`, then 256 `max_tokens` of
`randint(100, 1024)` (142,827 prompt tokens, 133,966 output tokens). A scaled-down variant for
quick runs keeps the same draws with other bounds: `num_requests` prompts, lengths up to
`max_input_len` / `max_output_len`, lower bounds scaled by the same 100/1024 ratio.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

NANO_VLLM_NUM_REQUESTS = 256
NANO_VLLM_MAX_INPUT_LEN = 1024
NANO_VLLM_MAX_OUTPUT_LEN = 1024
NANO_VLLM_MAX_TOKEN_ID = 10000
# nano-vllm's lower bound (100) over its upper bound (1024); the scaled variant keeps the ratio.
_MIN_LEN_NUMERATOR, _MIN_LEN_DENOMINATOR = 100, 1024

BENCHMARK_PRESET = "qwen3-0.6b"
_MODEL_FILES = ("config.json", "tokenizer.json", "model.safetensors")


@dataclass(frozen=True, slots=True)
class OfflineWorkload:
    prompts: list[list[int]]  # token ids, one list per request
    max_tokens: list[int]  # tokens to generate per request (EOS is ignored)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def fold_token_ids(self, vocab_size: int) -> OfflineWorkload:
        """The same lengths with ids taken modulo `vocab_size`, for models with a small vocab."""
        if all(t < vocab_size for p in self.prompts for t in p):
            return self
        return OfflineWorkload([[t % vocab_size for t in p] for p in self.prompts],
                               list(self.max_tokens))


def _min_len(max_len: int) -> int:
    return max(1, max_len * _MIN_LEN_NUMERATOR // _MIN_LEN_DENOMINATOR)


def nano_vllm_workload(
    num_requests: int = NANO_VLLM_NUM_REQUESTS,
    max_input_len: int = NANO_VLLM_MAX_INPUT_LEN,
    max_output_len: int = NANO_VLLM_MAX_OUTPUT_LEN,
    seed: int = 0,
) -> OfflineWorkload:
    """nano-vllm's workload; with the defaults, its exact prompts and lengths."""
    for name, value in (("num_requests", num_requests), ("max_input_len", max_input_len),
                        ("max_output_len", max_output_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    # A private generator drawing what `random.seed(seed)` + `random.randint` would draw.
    rng = random.Random(seed)
    min_input, min_output = _min_len(max_input_len), _min_len(max_output_len)
    prompts = [[rng.randint(0, NANO_VLLM_MAX_TOKEN_ID)
                for _ in range(rng.randint(min_input, max_input_len))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(min_output, max_output_len) for _ in range(num_requests)]
    return OfflineWorkload(prompts, max_tokens)


def random_prompts(num_prompts: int, length: int, vocab_size: int,
                   rng: random.Random) -> list[list[int]]:
    """Prompts of random ids below min(vocab_size, 10001), as nano-vllm draws them."""
    high = min(vocab_size - 1, NANO_VLLM_MAX_TOKEN_ID)
    return [[rng.randint(0, high) for _ in range(length)] for _ in range(num_prompts)]


def cache_root(env: dict[str, str]) -> Path:
    """sluice's cache folder: $SLUICE_CACHE_DIR, else $XDG_CACHE_HOME/sluice, else ~/.cache."""
    if env.get("SLUICE_CACHE_DIR"):
        return Path(env["SLUICE_CACHE_DIR"])
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "sluice"
    return Path.home() / ".cache" / "sluice"


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _MODEL_FILES)


def benchmark_model_dir(cache_dir: Path) -> str:
    """The Qwen3-0.6B architecture with random bf16 weights, built once under `cache_dir`."""
    from sluice.model.tiny import make_tiny_model

    target = cache_dir / f"random-{BENCHMARK_PRESET}"
    if _is_complete(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed, so a concurrent run never reads half a folder.
    staging = Path(tempfile.mkdtemp(prefix=f".random-{BENCHMARK_PRESET}-", dir=cache_dir))
    try:
        make_tiny_model(str(staging), preset=BENCHMARK_PRESET)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            if not _is_complete(target):  # else another run renamed its copy in first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
