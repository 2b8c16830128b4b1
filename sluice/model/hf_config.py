"""The parts of a Hugging Face `config.json` that sluice's models need, with HF's defaults.

Both config styles are read: transformers 4 (`rope_theta` + `rope_scaling`, `torch_dtype`) and
transformers 5 (`rope_parameters`, `dtype`). RoPE settings are normalised to `rope_theta` plus
`rope_scaling` (None for plain RoPE, else a dict with `rope_type`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from sluice.model.quant_config import Fp8Config, parse_quantization_config
from sluice.model.registry import resolve_architecture

SUPPORTED_ROPE_TYPES = ("default", "llama3")

# HF config-class defaults that differ per model type (fields absent from config.json).
_MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "head_dim": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {"vocab_size": 151936, "max_position_embeddings": 32768, "head_dim": None},
    "qwen3": {"vocab_size": 151936, "max_position_embeddings": 32768, "head_dim": 128},
    # transformers' MistralConfig / Phi3Config defaults (Mistral's sliding window is 4,096
    # when config.json names none)
    "mistral": {"vocab_size": 32000, "max_position_embeddings": 131072, "head_dim": None,
                "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "phi3": {"vocab_size": 32064, "max_position_embeddings": 4096, "head_dim": None,
             "bos_token_id": 1, "eos_token_id": 32000},
    "gemma3_text": {"vocab_size": 262208, "max_position_embeddings": 131072, "head_dim": 256,
                    "bos_token_id": 2, "eos_token_id": 1, "sliding_window": 4096,
                    "query_pre_attn_scalar": 256, "sliding_window_pattern": 6},
    "qwen3_moe": {"vocab_size": 151936, "max_position_embeddings": 32768, "head_dim": None,
                  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    # transformers' MixtralConfig: 8 experts, 2 a token, each of intermediate_size, the top 2
    # renormalized; no window unless config.json names one
    "mixtral": {"vocab_size": 32000, "max_position_embeddings": 131072, "head_dim": None,
                "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None,
                "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": []},
    # transformers' Qwen2MoeConfig (Qwen1.5-MoE-A2.7B's sizes)
    "qwen2_moe": {"vocab_size": 151936, "max_position_embeddings": 32768, "head_dim": None,
                  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
}
# Model types whose config.json `sliding_window` bounds their attention (Qwen2 / Qwen3 use it
# only with use_sliding_window, refused).
_SLIDING_WINDOW_TYPES = ("mistral", "mixtral", "phi3", "gemma3_text")
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE): `top_k` of `num_experts` experts a
    token, each a SwiGLU MLP of `intermediate_size`, weighted by the router's softmax over all
    experts (the top k renormalized to sum to 1 with `norm_topk_prob`); the layers in
    `dense_layers` keep a dense MLP of the config's intermediate_size."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    dense_layers: tuple[int, ...]
    # Qwen2-MoE: a shared SwiGLU expert of this size every token goes through, scaled by a
    # sigmoid gate of its own; None for Qwen3-MoE
    shared_intermediate_size: int | None = None


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """Gemma 3's text decoder beyond the Llama fields: per layer whether it attends in a
    sliding window (its RoPE base `local_rope_theta`) or globally (HFModelConfig.rope_theta);
    attention scaled by query_pre_attn_scalar ** -0.5; the final logits soft-capped at
    `final_logit_softcapping` (None: not)."""

    sliding_layers: tuple[bool, ...]
    local_rope_theta: float
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    # the global layers' linear RoPE scaling (the 4B-27B models: 8), None: none
    global_rope_factor: float | None = None


@dataclass(frozen=True, slots=True)
class HFModelConfig:
    architectures: list[str]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str | None  # "bfloat16" | "float16" | "float32" | None (not stated)
    attention_bias: bool  # bias on q/k/v (and o for Llama/Qwen3); always True for Qwen2 q/k/v
    eos_token_id: int | list[int] | None
    bos_token_id: int | None
    # config.json's quantization_config: FP8 weights (sluice.model.quantization), None for none
    quantization: Fp8Config | None = None
    # Each query attends to the last `sliding_window` positions only (itself included): every
    # layer of Mistral and Phi-3, Gemma 3's sliding layers (GemmaConfig.sliding_layers); None:
    # all.
    sliding_window: int | None = None
    # Qwen3-MoE's experts (sluice.model.moe); None for a dense model
    moe: MoeConfig | None = None
    # Gemma 3's layer types and scalings (sluice.model.models.gemma3); None for other models
    gemma: GemmaConfig | None = None

    def window_of_every_layer(self) -> int | None:
        """The sliding window where every layer attends in it (Mistral, Phi-3 with a window; a
        Gemma 3 whose every layer slides), else None (no window, or some global layer)."""
        if self.sliding_window is None:
            return None
        if self.gemma is not None and not all(self.gemma.sliding_layers):
            return None
        return self.sliding_window


def load_hf_config(model_dir: str) -> HFModelConfig:
    if not os.path.isdir(model_dir):
        raise ValueError(f"model folder {model_dir!r} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model folder {model_dir!r} has no config.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return parse_hf_config(raw)


def parse_hf_config(raw: dict[str, Any]) -> HFModelConfig:
    architectures = list(raw.get("architectures") or [])
    resolve_architecture(architectures)  # raises, listing the supported ones
    model_type = raw.get("model_type", "")
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration: its text model's config
        raw, model_type = _gemma3_text_config(raw), "gemma3_text"
    defaults = _MODEL_TYPE_DEFAULTS.get(model_type, _MODEL_TYPE_DEFAULTS["llama"])

    def get(key: str) -> Any:
        return raw[key] if raw.get(key) is not None else defaults.get(key)

    gemma = None
    if model_type == "gemma3_text":
        raw, gemma = _parse_gemma3(raw, get)
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hidden_act!r}")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported (allowed: false)")
    if raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported (allowed: false)")

    partial_rotary = raw.get("partial_rotary_factor", 1.0)
    if partial_rotary not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial_rotary!r} is not supported (allowed: "
                         "1.0, RoPE over the whole head)")
    sliding_window = None
    if model_type in _SLIDING_WINDOW_TYPES:  # an explicit null: no window
        sliding_window = (raw["sliding_window"] if "sliding_window" in raw
                          else defaults.get("sliding_window"))
    if gemma is not None and not any(gemma.sliding_layers):
        sliding_window = None
    if sliding_window is not None and (not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive integer or null, got "
                         f"{sliding_window!r}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(raw.get(key), int):
            raise ValueError(f"config.json must give an integer {key!r}, got {raw.get(key)!r}")
    num_heads = raw["num_attention_heads"]
    head_dim = get("head_dim") or raw["hidden_size"] // num_heads
    max_position_embeddings = get("max_position_embeddings")
    rope_theta, rope_scaling = _parse_rope(raw, max_position_embeddings)
    return HFModelConfig(
        architectures=architectures,
        model_type=model_type,
        vocab_size=get("vocab_size"),
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type == "gemma3_text")),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        attention_bias=(True if model_type == "qwen2"
                        else bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe"
                        else bool(raw.get("attention_bias", False))),
        eos_token_id=get("eos_token_id"),
        bos_token_id=get("bos_token_id"),
        quantization=parse_quantization_config(raw.get("quantization_config")),
        sliding_window=sliding_window,
        moe=(_parse_moe(raw, get, model_type)
             if model_type in ("qwen3_moe", "qwen2_moe", "mixtral") else None),
        gemma=gemma,
    )


def _gemma3_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config.json (the 4B-27B models: model_type gemma3)
    -> its `text_config` as a gemma3_text config, with the top level's token ids, dtype, tied
    embeddings and quantization where the text config does not set them. Only the text model
    runs (sluice.model.models.gemma3); the vision tower's weights are not read."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("a Gemma 3 (model_type 'gemma3') config.json must have a text_config")
    text = dict(text)
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings",
                "quantization_config"):
        if key in raw and text.get(key) is None:
            text[key] = raw[key]
    text["model_type"] = "gemma3_text"
    text["architectures"] = list(raw.get("architectures") or [])
    return text


def _parse_gemma3(raw: dict[str, Any], get: Any) -> tuple[dict[str, Any], GemmaConfig]:
    """Gemma 3's fields -> (raw with its RoPE and activation in the Llama form the rest of
    parse_hf_config reads, GemmaConfig). Both styles: transformers 5 (`rope_parameters` per
    layer type, `layer_types`) and 4 (`rope_theta`, `rope_local_base_freq`,
    `sliding_window_pattern`)."""
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3's hidden_activation must be 'gelu_pytorch_tanh', got "
                         f"{activation!r}")
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 2's; allowed: null)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (allowed: false)")
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = get("sliding_window_pattern")
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for "
                         f"each of the {layers} layers, got {types!r}")
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
    else:
        full = {"rope_type": (raw.get("rope_scaling") or {}).get("rope_type", "default"),
                "rope_theta": raw.get("rope_theta", 1e6), **(raw.get("rope_scaling") or {})}
        local = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 1e4)}
    allowed = {"full_attention": ("default", "linear"), "sliding_attention": ("default",)}
    for name, rope in (("full_attention", full), ("sliding_attention", local)):
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in allowed[name]:
            raise ValueError(f"Gemma 3's {name} rope_type {rope_type!r} is not supported "
                             f"(allowed: {list(allowed[name])})")
    factor = None
    if (full.get("rope_type") or full.get("type")) == "linear":
        factor = full.get("factor")
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"Gemma 3's linear RoPE scaling needs a positive factor, got "
                             f"{factor!r}")
        factor = float(factor)
    rewritten = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    rewritten["rope_theta"] = float(full.get("rope_theta", 1e6))
    rewritten["hidden_act"] = "silu"  # checked above: the MLP is Gemma's own
    return rewritten, GemmaConfig(
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        local_rope_theta=float(local.get("rope_theta", 1e4)),
        query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        global_rope_factor=factor)


def _parse_moe(raw: dict[str, Any], get: Any, model_type: str) -> MoeConfig:
    # transformers 5 writes num_experts as num_local_experts
    num_experts = raw.get("num_experts") or raw.get("num_local_experts") or get("num_experts")
    top_k = get("num_experts_per_tok")
    inter, step = get("moe_intermediate_size"), get("decoder_sparse_step")
    if model_type == "mixtral":  # each expert is an MLP of intermediate_size, always renormalized
        num_experts = raw.get("num_local_experts") or 8
        inter = raw["intermediate_size"]
    for key, value in (("num_experts", num_experts), ("num_experts_per_tok", top_k),
                       ("moe_intermediate_size", inter), ("decoder_sparse_step", step)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be <= num_experts "
                         f"({num_experts})")
    shared = None
    if model_type == "qwen2_moe":
        shared = get("shared_expert_intermediate_size")
        if not isinstance(shared, int) or shared < 1:
            raise ValueError(f"shared_expert_intermediate_size must be a positive integer, got "
                             f"{shared!r}")
    only = get("mlp_only_layers") or []
    layers = raw["num_hidden_layers"]
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    norm = True if model_type == "mixtral" else bool(get("norm_topk_prob"))
    return MoeConfig(num_experts, top_k, inter, norm, dense, shared)


def _parse_rope(
    raw: dict[str, Any], max_position_embeddings: int
) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds rope_theta into rope_parameters; transformers 4 keeps it top level.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported, got {params!r}")
    rope_theta = float(params.get("rope_theta") or raw.get("rope_theta") or _DEFAULT_ROPE_THETA)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported (supported: {list(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return rope_theta, None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"llama3 rope scaling needs {missing}, got {params!r}")
    return rope_theta, {
        "rope_type": "llama3",
        "factor": float(params["factor"]),
        "low_freq_factor": float(params["low_freq_factor"]),
        "high_freq_factor": float(params["high_freq_factor"]),
        "original_max_position_embeddings": int(
            params.get("original_max_position_embeddings") or max_position_embeddings
        ),
    }
