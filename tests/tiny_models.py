"""The tests' tiny random models: one shape (TINY_DIMS: hidden 64, 2 layers, 4 query heads and 2
KV heads of 16 dims, MLP 128) for each architecture sluice loads, built by Hugging Face
transformers in float32 (`build_hf_model`) and saved with the built-in byte-level BPE tokenizer
where a test needs a model folder (`save_hf_model`), which sluice loads through the same loader
as real folders. A test that needs another shape passes its fields."""

from __future__ import annotations

from typing import Any

import torch

ARCHS = ("qwen3", "llama", "qwen2", "mistral", "phi3", "qwen3_moe", "qwen2_moe", "mixtral",
         "gemma3")
TINY_DIMS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
# arch -> (transformers config class, model class)
_HF_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "llama": ("LlamaConfig", "LlamaForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM"),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
               "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
               "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
# Config fields an arch needs at the tiny size: Phi-3's default pad id (32000) is past the
# tiny vocabularies.
# Qwen3-MoE: 8 experts of 32, 2 a token, renormalized; layer 1 dense (mlp_only_layers).
# Qwen2-MoE: as Qwen3-MoE, not renormalized, with a shared expert.
_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "phi3": dict(pad_token_id=None),
    # Gemma 3: layer 0 in a (wide) sliding window with its RoPE base, layer 1 global
    "gemma3": dict(pad_token_id=None, sliding_window=512, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    # Qwen2-MoE: 8 experts of 32, 2 a token, not renormalized (Qwen1.5-MoE's choice), and a
    # gated shared expert of 48 in every sparse layer; layer 1 dense
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[1]),
    # Mixtral: 6 experts of the MLP's 128, 2 a token, every layer sparse
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2),
}
# The folders' own choices per arch: Qwen3 ties its embeddings, Llama has llama3 RoPE scaling.
_FOLDER_CONFIG: dict[str, dict[str, Any]] = {
    "qwen3": dict(tie_word_embeddings=True),
    "llama": dict(tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    "qwen2": dict(tie_word_embeddings=False),
    # Mistral keeps MistralConfig's 4,096-token window (past every test's max_model_len)
    "mistral": dict(tie_word_embeddings=False),
    "phi3": dict(tie_word_embeddings=False),
    "qwen3_moe": dict(tie_word_embeddings=False),
    "qwen2_moe": dict(tie_word_embeddings=False),
    "mixtral": dict(tie_word_embeddings=False),
    "gemma3": dict(tie_word_embeddings=True),
}


def build_hf_model(arch: str, seed: int = 0, overrides: dict[str, Any] | None = None,
                   **config: Any) -> Any:
    """A random transformers model of `arch` (one of ARCHS) in float32, eval mode: its
    config class given TINY_DIMS and `config` (which win), then `overrides` set on the config;
    the weights drawn after torch.manual_seed(seed)."""
    import transformers

    if arch not in _HF_CLASSES:
        raise ValueError(arch)
    config_name, model_name = _HF_CLASSES[arch]
    hf_config = getattr(transformers, config_name)(
        **{**TINY_DIMS, **_ARCH_CONFIG.get(arch, {}), **config})
    for key, value in (overrides or {}).items():
        setattr(hf_config, key, value)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(hf_config).to(torch.float32).eval()


def save_hf_model(out_dir: str, arch: str, seed: int = 0, **overrides: object) -> str:
    """Build a tiny transformers model of `arch`, save it with its tokenizer, return the folder.
    `overrides`: config fields set after the config is made (another shape, another vocab)."""
    from sluice.model.tiny import build_tokenizer

    tokenizer = build_tokenizer(out_dir)
    model = build_hf_model(
        arch, seed, overrides,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        **_FOLDER_CONFIG.get(arch, {}))
    model.save_pretrained(out_dir)
    return out_dir
