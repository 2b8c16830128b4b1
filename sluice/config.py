"""Frozen configuration, built once from keyword arguments or CLI flags. Defaults live here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

# Imported at run time (not only for type checkers) so that msgspec can resolve the annotations
# when EngineConfig travels to worker processes.
from sluice.model.hf_config import HFModelConfig
from sluice.spec_decode.config import SpeculativeConfig
from sluice.validation import verify_positive


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a Hugging Face model folder (for a .gguf file, the folder made of it)
    tokenizer: str  # folder with tokenizer.json (usually the model folder)
    name: str = ""  # the model as the user named it (or the built-in model's name)
    dtype: str = "auto"  # "auto" (from config.json) | "float32" | "bfloat16" | "float16"
    seed: int = 0
    max_model_len: int | None = None  # None: from config.json
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    attention_backend: str = "auto"  # "auto": triton on a GPU, torch_ref on the CPU
    enforce_eager: bool = False  # no CUDA graphs, no torch.compile
    # Dense (cuDNN) attention for lone prompts where the attention backend offers it.
    dense_prefill: bool = True


# kv_cache_dtype values: "auto" (the model's dtype), "fp8" and its alias "fp8_e4m3", "fp8_e5m2"
# (sluice.attention.kv_layout).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # Fraction of device memory for weights, activations and KV cache (GPU).
    gpu_memory_utilization: float = 0.9
    # KV cache budget when running on the CPU.
    cpu_kv_cache_bytes: int = 4 << 30
    # "auto": the model's dtype; "fp8" / "fp8_e4m3": float8_e4m3fn; "fp8_e5m2": float8_e5m2
    # (sluice.attention.kv_layout)
    kv_cache_dtype: str = "auto"


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


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # "uni": the model runs in the engine's process; "mp": one worker process per rank.
    distributed_executor_backend: str = "uni"
    # The MoE layers' experts partitioned whole over the tensor-parallel ranks (E / N each)
    # instead of each expert sliced N ways; the attention stays tensor-parallel.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        verify_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}")
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend != "mp":
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs "
                f"distributed_executor_backend='mp' (one process per rank), got "
                f"{self.distributed_executor_backend!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector, in vLLM's shape (`LLM(kv_transfer_config={...})`,
    `--kv-transfer-config JSON`). Built with `from_dict`, which names unknown keys."""

    # A name known to sluice.kv_transfer.factory, or a class in kv_connector_module_path.
    kv_connector: str
    kv_role: str = "kv_both"
    # Settings of the connector itself (each connector validates its own keys).
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # Where a connector class not built into sluice lives ("package.module").
    kv_connector_module_path: str | None = None
    # Names this instance to its peers (PD disaggregation); None: a random id.
    engine_id: str | None = None
    # What a failed KV load does: "recompute" the tokens of the failed blocks, or "fail" the
    # request with an error.
    kv_load_failure_policy: str = "recompute"
    # A request aborted while its KV is loading keeps its blocks until the load ends, or this
    # long at most (then they are freed even if the connector never reported the load done).
    kv_load_abort_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_transfer_config.kv_connector must be a connector name, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {KV_ROLES}, "
                             f"got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config must be an object, "
                             f"got {self.kv_connector_extra_config!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy must be one of "
                             f"{KV_LOAD_FAILURE_POLICIES}, got {self.kv_load_failure_policy!r}")
        timeout = self.kv_load_abort_timeout_s
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                or not timeout > 0):
            raise ValueError(f"kv_transfer_config.kv_load_abort_timeout_s must be a number > 0, "
                             f"got {timeout!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, value: dict | str | KVTransferConfig | None) -> KVTransferConfig | None:
        """From a dict, its JSON text, or a config (returned as is); None stays None."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not valid JSON: {exc}") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be an object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown keys {unknown}; allowed: "
                             f"{sorted(known)}")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config needs 'kv_connector'")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class EngineConfig:
    """Every config of one engine, built once by EngineArgs.create_engine_config."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    hf_config: HFModelConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None
