"""Frozen configuration, built once from keyword arguments or CLI flags. Defaults live here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a Hugging Face model folder
    tokenizer: str  # folder with tokenizer.json (usually the model folder)
    dtype: str = "auto"  # "auto" (from config.json) | "float32" | "bfloat16" | "float16"
    seed: int = 0
    max_model_len: int | None = None  # None: from config.json
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    attention_backend: str = "auto"  # "auto": triton on a GPU, torch_ref on the CPU
    enforce_eager: bool = False  # no CUDA graphs, no torch.compile


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # Fraction of device memory for weights, activations and KV cache (GPU).
    gpu_memory_utilization: float = 0.9
    # KV cache budget when running on the CPU.
    cpu_kv_cache_bytes: int = 4 << 30


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    # Prompts being prefilled in chunks at once, and the chunk size cap for "long" prompts
    # (0: no cap beyond the token budget).
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    # Schedule step N+1 while the device computes step N (outputs arrive one step later).
    async_scheduling: bool = False
    # Speculative decoding (None: off). Read by the scheduler (1 + k tokens per decode, lookahead
    # slots) and by the model runner (proposer, verification).
    speculative_config: SpeculativeConfig | None = None


def verify_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
