"""The EAGLE-1 draft head: one decoder layer that predicts the target's next feature.

    x = fc(cat([embed(token[t + 1]), target_hidden[t]], -1))       # [T, hidden]
    h = x + attn(x)                  # no input_layernorm: EAGLE-1 heads ship none
    out = h + mlp(post_attention_layernorm(h))                     # [T, hidden]

`target_hidden` is the target's last hidden state AFTER its final norm (what `model(...)` returns
in sluice, `outputs[0]` of HF's base model in EAGLE's `EaModel`), the token is the one that
follows it, and the position is the hidden state's. The runner turns `out` into logits with the
target's `compute_logits` (the target's LM head; the head has no norm and no LM head of its own)
and feeds `out` back as `target_hidden` for the next draft token. The decoder layer is the
target's kind (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k norms); its attention has its own KV
cache, bound with `bind_kv_caches(head, {"layers.0.self_attn.attn": kv_cache})`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from sluice.attention.backend import AttentionBackend
from sluice.attention.metadata import AttentionMetadata
from sluice.model.attention import name_attention_layers
from sluice.model.embed_head import VocabParallelEmbedding
from sluice.model.hf_config import HFModelConfig, parse_hf_config
from sluice.model.layers import RMSNorm, RotaryEmbedding
from sluice.model.linear import Linear
from sluice.model.loader import iterate_weights, load_packed_weights, safetensors_files
from sluice.model.models.llama import PACKED_MODULES, LlamaMLP


class EagleDecoderLayer(nn.Module):
    """The target's decoder layer without input_layernorm: fc's output goes straight in."""

    def __init__(self, self_attn: nn.Module, config: HFModelConfig) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """positions: [T]; hidden: [T, hidden] -> [T, hidden] (MLP output + residual)."""
        residual = hidden
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) + residual


class EagleHead(nn.Module):
    def __init__(
        self,
        config: HFModelConfig,
        build_attention: Callable[[RotaryEmbedding], nn.Module],
        fc_bias: bool,
        shared_embed_tokens: VocabParallelEmbedding | None = None,
    ) -> None:
        """shared_embed_tokens: the target's table, used as is when the checkpoint has none."""
        super().__init__()
        self.config = config
        self.shares_embed_tokens = shared_embed_tokens is not None
        self.embed_tokens = (
            shared_embed_tokens
            if shared_embed_tokens is not None
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        )
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList([EagleDecoderLayer(build_attention(rotary_emb), config)])

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64: the token after each target hidden state
        target_hidden: torch.Tensor,  # [T, hidden]: the target's (or the head's last) output
        positions: torch.Tensor,  # [T] int64: the positions of target_hidden
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        hidden = self.fc(torch.cat([self.embed_tokens(input_ids), target_hidden], dim=-1))
        return self.layers[0](positions, hidden, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """EAGLE-1 names (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...), with or
        without a leading "model."; a `lm_head.weight` is ignored (the target's LM head rules)."""
        named = ((name.removeprefix("model."), tensor) for name, tensor in weights)
        if self.shares_embed_tokens:
            # The target's table is already loaded; offering it as its own tensor (a copy onto
            # itself) lets the completeness check count it.
            named = chain(named, [("embed_tokens.weight", self.embed_tokens.weight)])
        load_packed_weights(self, named, PACKED_MODULES, skip=("lm_head.weight", "inv_freq"))


def _read_config(model_dir: str, target_hf_config: HFModelConfig) -> HFModelConfig:
    """The head's config.json, parsed as one of the target's kind: EAGLE heads name their
    architecture variously (LlamaForCausalLM, LlamaForCausalLMEagle, ...)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"EAGLE head folder {model_dir!r} has no config.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    config = parse_hf_config({**raw, "architectures": target_hf_config.architectures})
    if config.num_hidden_layers != 1:
        raise ValueError(
            f"EAGLE-1 heads have num_hidden_layers 1, {path!r} has {config.num_hidden_layers}"
        )
    for field in ("hidden_size", "vocab_size", "head_dim"):
        head_value, target_value = getattr(config, field), getattr(target_hf_config, field)
        if head_value != target_value:
            raise ValueError(
                f"EAGLE head {field} ({head_value}) must equal the target's ({target_value})"
            )
    # Positions come from the target's sequences (EAGLE-LLaMA3 heads say 2048, the target 8192).
    max_positions = max(config.max_position_embeddings, target_hf_config.max_position_embeddings)
    return dataclasses.replace(config, max_position_embeddings=max_positions)


def _checkpoint_files(model_dir: str) -> list[str]:
    has_safetensors = os.path.isdir(model_dir) and any(
        name.endswith(".safetensors") for name in os.listdir(model_dir)
    )
    if not has_safetensors and os.path.isfile(os.path.join(model_dir, "pytorch_model.bin")):
        raise ValueError(
            f"EAGLE head folder {model_dir!r} has only pytorch_model.bin: safetensors weights "
            "are required (pickled checkpoints are never loaded); convert it to model.safetensors"
        )
    return safetensors_files(model_dir)


def _tensor_names(files: list[str]) -> set[str]:
    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names.update(name.removeprefix("model.") for name in f.keys())
    return names


def load_eagle_head(
    model_dir: str,
    target_model: nn.Module,
    target_hf_config: HFModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend,
) -> EagleHead:
    """The EAGLE-1 head of `model_dir` for `target_model` (a sluice Llama/Qwen2/Qwen3 model),
    in eval mode. Without `embed_tokens.weight` it shares the target's embedding table."""
    config = _read_config(model_dir, target_hf_config)
    files = _checkpoint_files(model_dir)
    names = _tensor_names(files)
    shared = None if "embed_tokens.weight" in names else target_model.model.embed_tokens
    build_attention = type(target_model).attention_builder(config, attn_backend)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(config, build_attention, "fc.bias" in names, shared)
    finally:
        torch.set_default_dtype(previous_dtype)
    name_attention_layers(head)
    with torch.no_grad():
        head.load_weights(iterate_weights(files, dtype))
    return head.eval().requires_grad_(False)


def _eagle_weight_shapes(
    config: HFModelConfig, with_embeddings: bool, fc_bias: bool
) -> Iterator[tuple[str, tuple[int, ...]]]:
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    if with_embeddings:
        yield "embed_tokens.weight", (config.vocab_size, hidden)
    yield "fc.weight", (hidden, 2 * hidden)
    if fc_bias:
        yield "fc.bias", (hidden,)
    p = "layers.0."
    projections = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
    for name, size in projections.items():
        yield f"{p}self_attn.{name}.weight", (size, hidden)
        if config.attention_bias:  # always for Qwen2
            yield f"{p}self_attn.{name}.bias", (size,)
    yield f"{p}self_attn.o_proj.weight", (hidden, q_size)
    if config.attention_bias and config.model_type != "qwen2":
        yield f"{p}self_attn.o_proj.bias", (hidden,)
    if config.model_type == "qwen3":
        yield f"{p}self_attn.q_norm.weight", (head_dim,)
        yield f"{p}self_attn.k_norm.weight", (head_dim,)
    yield f"{p}post_attention_layernorm.weight", (hidden,)
    yield f"{p}mlp.gate_proj.weight", (inter, hidden)
    yield f"{p}mlp.up_proj.weight", (inter, hidden)
    yield f"{p}mlp.down_proj.weight", (hidden, inter)


def make_tiny_eagle(
    target_dir: str,
    out_dir: str,
    seed: int = 0,
    with_embeddings: bool = False,
    fc_bias: bool = True,
) -> str:
    """Write a random float32 EAGLE-1 head folder for the (tiny) target in `target_dir`:
    config.json (the target's, one layer, EAGLE's `bias` flag) and model.safetensors with
    EAGLE-1 tensor names. Norm weights are 1 +- 0.1 so a misplaced one shows."""
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    raw.update(num_hidden_layers=1, bias=fc_bias)
    if isinstance(raw.get("layer_types"), list):
        raw["layer_types"] = raw["layer_types"][:1]
    config = parse_hf_config(raw)
    generator = torch.Generator().manual_seed(seed)
    std = config.hidden_size**-0.5  # keeps fc, attention and MLP outputs O(1)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in _eagle_weight_shapes(config, with_embeddings, fc_bias):
        noise = torch.randn(shape, generator=generator)
        weights[name] = 1 + 0.1 * noise if name.endswith("norm.weight") else std * noise
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)
