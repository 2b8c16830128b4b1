"""The roofline of an offline workload: the fastest a GPU could possibly run it.

Decode is bound by memory bandwidth: every decode step reads all weights once (the steps are as
many as the longest output), and every generated token reads its whole KV context once (the
prompt and the tokens generated before it). Prefill is bound by compute: the linear layers at
2 FLOPs per weight per prompt token, causal attention, and one row of logits per prompt. The two
times add. For nano-vllm's workload on Qwen3-0.6B in bf16 and an H200 (4.8 TB/s, 989 TFLOP/s)
that is 15.1 TB read in 3.14 s plus 0.14 s of prefill: 40,812 output tok/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.model.hf_config import HFModelConfig


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    hbm_bytes_per_s: float  # peak memory bandwidth
    dense_flops_per_s: float  # peak dense bf16 tensor-core throughput


GPU_SPECS: dict[str, GpuSpec] = {
    "h200": GpuSpec("NVIDIA H200", 4.8e12, 989e12),
    "h100": GpuSpec("NVIDIA H100 SXM", 3.35e12, 989e12),
    "a100": GpuSpec("NVIDIA A100 80GB SXM", 2.039e12, 312e12),
}
DEFAULT_GPU_SPEC = "h200"


def gpu_spec_for(key: str, device_name: str | None = None) -> GpuSpec:
    """A spec by key; "auto" picks the one whose key is in `device_name`, else the H200's."""
    if key == "auto":
        lowered = (device_name or "").lower()
        matches = [k for k in GPU_SPECS if k in lowered]
        return GPU_SPECS[matches[0] if matches else DEFAULT_GPU_SPEC]
    if key not in GPU_SPECS:
        raise ValueError(f"gpu spec must be one of {['auto', *GPU_SPECS]}, got {key!r}")
    return GPU_SPECS[key]


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What one token costs a dense decoder: bytes read and FLOPs."""

    weight_bytes: int  # read once per decode step: layers, final norm, LM head
    kv_bytes_per_token: int  # K and V of one token, all layers
    linear_flops_per_token: int  # prefill: 2 x the decoder layers' weights
    attention_flops_per_pair: int  # one query attending one key, all layers and heads (QK + PV)
    lm_head_flops: int  # one row of logits

    @classmethod
    def from_hf_config(cls, config: HFModelConfig, dtype_bytes: int,
                       kv_dtype_bytes: int | None = None) -> ModelCost:
        """`kv_dtype_bytes`: bytes of a KV cache element (1 for an 8-bit cache); default the
        model's `dtype_bytes`."""
        hidden, head_dim = config.hidden_size, config.head_dim
        q_size = config.num_attention_heads * head_dim
        kv_size = config.num_key_value_heads * head_dim
        layer = (hidden * q_size + 2 * hidden * kv_size + q_size * hidden  # q, k, v, o
                 + 3 * hidden * config.intermediate_size  # gate, up, down
                 + 2 * hidden)  # input and post-attention norms
        if config.attention_bias:
            layer += q_size + 2 * kv_size + (hidden if config.model_type != "qwen2" else 0)
        if config.model_type == "qwen3":
            layer += 2 * head_dim  # per-head q and k norms
        lm_head = config.vocab_size * hidden
        # A tied LM head is the embedding table: read once per step as the LM head. An untied
        # embedding table is only gathered (a few rows), so it is left out.
        decode_params = config.num_hidden_layers * layer + hidden + lm_head
        return cls(
            weight_bytes=decode_params * dtype_bytes,
            kv_bytes_per_token=2 * config.num_hidden_layers * kv_size
            * (dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes),
            linear_flops_per_token=2 * config.num_hidden_layers * layer,
            attention_flops_per_pair=4 * config.num_hidden_layers * q_size,
            lm_head_flops=2 * lm_head,
        )


@dataclass(frozen=True, slots=True)
class Roofline:
    spec: GpuSpec
    output_tokens: int
    decode_steps: int
    decode_bytes: int  # weights per step plus every generated token's KV context
    decode_seconds: float
    prefill_flops: int
    prefill_seconds: float

    @property
    def seconds(self) -> float:
        return self.decode_seconds + self.prefill_seconds

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds


def offline_roofline(cost: ModelCost, prompt_lens: Sequence[int], max_tokens: Sequence[int],
                     spec: GpuSpec) -> Roofline:
    if len(prompt_lens) != len(max_tokens) or not prompt_lens:
        raise ValueError(f"need one max_tokens per prompt and at least one prompt, got "
                         f"{len(prompt_lens)} prompts and {len(max_tokens)} max_tokens")
    decode_steps = max(max_tokens)
    # Output token t (from 0) of a prompt of length p reads the KV of p + t tokens.
    kv_token_reads = sum(m * p + m * (m - 1) // 2 for p, m in zip(prompt_lens, max_tokens))
    decode_bytes = decode_steps * cost.weight_bytes + kv_token_reads * cost.kv_bytes_per_token
    # Causal attention: query i of a prompt attends i + 1 keys.
    causal_pairs = sum(p * (p + 1) // 2 for p in prompt_lens)
    prefill_flops = (sum(prompt_lens) * cost.linear_flops_per_token
                     + causal_pairs * cost.attention_flops_per_pair
                     + len(prompt_lens) * cost.lm_head_flops)
    return Roofline(
        spec=spec,
        output_tokens=sum(max_tokens),
        decode_steps=decode_steps,
        decode_bytes=decode_bytes,
        decode_seconds=decode_bytes / spec.hbm_bytes_per_s,
        prefill_flops=prefill_flops,
        prefill_seconds=prefill_flops / spec.dense_flops_per_s,
    )
