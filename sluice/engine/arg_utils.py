"""Engine arguments: the keyword arguments of `LLM(...)` and the CLI flags, validated once and
turned into the frozen configs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from sluice.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from sluice.distributed.head_split import check_tp_size
from sluice.model.hf_config import HFModelConfig, load_hf_config
from sluice.model.hub import resolve_model_path, sluice_cache_dir
from sluice.spec_decode.config import SpeculativeConfig
from sluice.validation import verify_positive

logger = logging.getLogger("sluice")

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class EngineArgs:
    model: str | None = None  # None: the built-in model
    tokenizer: str | None = None
    # A folder whose config.json replaces the one a .gguf model's metadata gives.
    hf_config_path: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 4 << 30
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "fp8" = "fp8_e4m3" | "fp8_e5m2"
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    dense_prefill: bool = True
    # None: on when running on a GPU. With speculative decoding, drafts are then proposed on
    # the device (every proposer), so steps with drafts overlap too.
    async_scheduling: bool | None = None
    # {"method": "ngram" | "draft_model" | "eagle", "num_speculative_tokens": k, ...}, its JSON
    # string, or a SpeculativeConfig; None: no speculative decoding.
    speculative_config: dict | str | SpeculativeConfig | None = None
    tensor_parallel_size: int = 1
    # --enable-expert-parallel: a mixture of experts' experts partitioned whole over the
    # tensor-parallel ranks (E / N each, no slicing); ignored, with a logged note, for a
    # dense model or at tensor_parallel_size 1.
    enable_expert_parallel: bool = False
    # "uni" (the model in the engine's process) | "mp" (a worker process per rank); None: "uni"
    # at tensor_parallel_size 1, else "mp".
    distributed_executor_backend: str | None = None
    # {"kv_connector": ..., "kv_role": ..., "kv_connector_extra_config": {...}}, its JSON string,
    # or a KVTransferConfig; None: no KV connector.
    kv_transfer_config: dict | str | KVTransferConfig | None = None
    # GiB of host memory for a CPU tier of the KV cache (shorthand for the OffloadingConnector).
    kv_offloading_size: float | None = None
    # Prefill/decode disaggregation (shorthand for the PDConnector): "prefill" | "decode" | None,
    # the prefill's bootstrap server port (0: a free one), and the transfer backend.
    disaggregation_mode: str | None = None
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "auto"
    # Accepted for compatibility with vLLM scripts.
    trust_remote_code: bool = False
    disable_log_stats: bool = True

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; allowed: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def create_engine_config(self) -> EngineConfig:
        model, model_name, chat_template = self.model, self.model, None
        if model is None:
            from sluice.model.builtin import builtin_model

            builtin = builtin_model(sluice_cache_dir())
            model, model_name, chat_template = builtin.path, builtin.name, builtin.chat_template
        model = resolve_model_path(model)  # a hub id: its snapshot in the HF cache
        tokenizer = resolve_model_path(self.tokenizer) if self.tokenizer else None
        if model.endswith(".gguf"):
            from sluice.model.gguf_loader import prepare_gguf_folder

            model = prepare_gguf_folder(model, sluice_cache_dir(), self.hf_config_path,
                                        tokenizer, chat_template)
        elif self.hf_config_path is not None:
            raise ValueError(f"hf_config_path ({self.hf_config_path!r}) is for a .gguf model; "
                             f"the model {model!r} has its own config.json")
        hf_config = load_hf_config(model)

        self._check_tensor_parallel_size(hf_config)
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self._expert_parallel(hf_config),
            distributed_executor_backend=self.distributed_executor_backend or (
                "uni" if self.tensor_parallel_size == 1 else "mp"))
        kv_transfer_config = self._kv_transfer_config()
        for name in ("block_size", "max_num_seqs", "max_num_partial_prefills"):
            verify_positive(name, getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override"):
            verify_positive(name, getattr(self, name), allow_none=True)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, "
                             f"got {self.long_prefill_token_threshold!r}")

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")

        speculative_config = SpeculativeConfig.from_dict(self.speculative_config)

        max_model_len = self.max_model_len or hf_config.max_position_embeddings
        if max_model_len > hf_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) must be <= the model's "
                f"max_position_embeddings ({hf_config.max_position_embeddings})")
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = _DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                max_batched = max(max_batched, max_model_len)
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be >= max_model_len "
                f"({max_model_len}) when chunked prefill is disabled: a whole prompt must fit "
                "in one step")

        model_config = ModelConfig(
            model=model,
            name=model_name,
            tokenizer=tokenizer or model,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=max_model_len,
            device=self.device,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            dense_prefill=self.dense_prefill,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cpu_kv_cache_bytes=self.cpu_kv_cache_bytes,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_batched_tokens=max_batched,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_partial_prefills=self.max_num_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            async_scheduling=self._async_scheduling(),
            speculative_config=speculative_config,
        )
        return EngineConfig(model_config, cache_config, scheduler_config, hf_config,
                            parallel_config, kv_transfer_config)

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        config = KVTransferConfig.from_dict(self.kv_transfer_config)
        if self.disaggregation_mode is not None:
            config = self._disaggregation_config(config)
        if config is not None and config.kv_connector == "PDConnector":
            from sluice.kv_transfer.disagg.config import with_bootstrap_port_chosen

            config = with_bootstrap_port_chosen(config)
        size = self.kv_offloading_size
        if size is None:
            return config
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"kv_offloading_size must be a number of GiB > 0, got {size!r}")
        if config is not None:
            raise ValueError(
                f"kv_offloading_size ({size}) is a shorthand for a kv_transfer_config with the "
                f"OffloadingConnector; give one or the other, not both (kv_transfer_config "
                f"names {config.kv_connector!r})")
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes_to_use": int(size * 2**30)})

    def _disaggregation_config(self, config: KVTransferConfig | None) -> KVTransferConfig:
        """--disaggregation-mode prefill|decode as the PDConnector's kv_transfer_config. A
        decode instance fails a request whose KV does not arrive (the router retries it on
        another prefill) rather than computing the prompt itself."""
        mode = self.disaggregation_mode
        roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
        if mode not in roles:
            raise ValueError(f"disaggregation_mode must be 'prefill' or 'decode', got {mode!r}")
        if config is not None:
            raise ValueError(f"disaggregation_mode ({mode!r}) is a shorthand for a "
                             f"kv_transfer_config with the PDConnector; give one or the other, "
                             f"not both (kv_transfer_config names {config.kv_connector!r})")
        extra = {"transfer_backend": self.disaggregation_transfer_backend,
                 "bootstrap_port": self.disaggregation_bootstrap_port}
        return KVTransferConfig(kv_connector="PDConnector", kv_role=roles[mode],
                                kv_connector_extra_config=extra,
                                kv_load_failure_policy="fail" if mode == "decode"
                                else "recompute")

    def _check_tensor_parallel_size(self, hf_config: HFModelConfig) -> None:
        """ValueErrors naming both numbers: the model's heads (and MLP) must split over the
        ranks, and on CUDA every rank needs a GPU of its own."""
        tp_size = self.tensor_parallel_size
        verify_positive("tensor_parallel_size", tp_size)
        if tp_size == 1:
            return
        check_tp_size(tp_size, hf_config.num_attention_heads, hf_config.num_key_value_heads,
                      hf_config.intermediate_size)
        if self._on_cuda():
            import torch

            num_gpus = torch.cuda.device_count()
            if tp_size > num_gpus:
                raise ValueError(f"tensor_parallel_size ({tp_size}) exceeds the visible GPUs "
                                 f"({num_gpus}): one GPU per rank")

    def _expert_parallel(self, hf_config: HFModelConfig) -> bool:
        """enable_expert_parallel where it means something: a mixture of experts at
        tensor_parallel_size N > 1 whose expert count N divides (else a ValueError naming both
        numbers). Elsewhere ignored with a logged note, as vLLM ignores it."""
        if not self.enable_expert_parallel:
            return False
        tp_size, moe = self.tensor_parallel_size, hf_config.moe
        if moe is None or tp_size == 1:
            why = "the model has no experts" if moe is None else "tensor_parallel_size is 1"
            logger.info("enable_expert_parallel ignored: %s", why)
            return False
        if moe.num_experts % tp_size:
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size ({tp_size}) must "
                             f"divide the model's num_experts ({moe.num_experts}), each rank "
                             f"holding num_experts / tensor_parallel_size whole experts")
        logger.info("expert parallelism: %d experts a layer over %d ranks, %d whole experts "
                    "each; the attention tensor-parallel", moe.num_experts, tp_size,
                    moe.num_experts // tp_size)
        return True

    def _on_cuda(self) -> bool:
        if self.device == "auto":
            import torch

            return torch.cuda.is_available()
        return self.device.startswith("cuda")

    def _async_scheduling(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self._on_cuda()
