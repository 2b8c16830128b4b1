"""GGUF files for the loader tests, written with the gguf package's GGUFWriter the way llama.cpp's
converter lays them out: llama.cpp tensor names, `<arch>.*` metadata, llama's query and key rows
interleaved per head, Llama 3.1's RoPE scaling as `rope_freqs.weight`.

Weights come from a Hugging Face folder (quantized by the gguf package where it can), or for the
K-quant types, which it cannot quantize, are random blocks with small scales: transformers reads
the same file, so either is a reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Byte offsets of each K-quant block's float16 scale fields (d, and dmin where it has one).
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                    "Q6_K": (208,)}


def _permute_for_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's (2, pairs) order within each head -> llama.cpp's (pairs, 2)."""
    rows = weight.shape[0]
    head = rows // num_heads
    return (weight.reshape(num_heads, 2, head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _random_k_blocks(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType,
                     rng: np.random.Generator) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype.name]:
        scales = rng.uniform(0.0005, 0.002, num_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def _encode(array: np.ndarray, type_name: str, rng: np.random.Generator
            ) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in K_QUANTS:
        return _random_k_blocks(array.shape, qtype, rng), qtype
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_gguf(hf_dir: str, out_path: str, tensor_types: list[str] | None = None,
               seed: int = 0, drop: tuple[str, ...] = (),
               metadata: dict[str, object] | None = None) -> str:
    """The Hugging Face model in `hf_dir` as a GGUF file. Matrices take the types of
    `tensor_types` in turn (F32 when None), vectors stay F32; `drop`: llama.cpp tensor names
    to leave out; `metadata`: keys to add or (None) leave out. No tokenizer in the file."""
    from safetensors.torch import load_file

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = config["model_type"]
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    state = load_file(str(Path(hf_dir) / "model.safetensors"))
    writer = gguf.GGUFWriter(out_path, arch)
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    fields: dict[str, object] = {
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": num_heads,
        f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.rope.freq_base": float((config.get("rope_parameters") or {}).get(
            "rope_theta", config.get("rope_theta", 10000.0))),
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.vocab_size": config["vocab_size"],
        "tokenizer.ggml.bos_token_id": config["bos_token_id"],
        "tokenizer.ggml.eos_token_id": config["eos_token_id"],
    }
    fields.update(metadata or {})
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))

    rng = np.random.default_rng(seed)
    types = list(tensor_types or ["F32"])
    matrices = 0
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3" and "rope_freqs.weight" not in drop:
        from sluice.model.layers import rope_inv_freq

        plain = rope_inv_freq(head_dim, fields[f"{arch}.rope.freq_base"])
        scaled = rope_inv_freq(head_dim, fields[f"{arch}.rope.freq_base"], {
            "rope_type": "llama3", "factor": rope["factor"],
            "low_freq_factor": rope["low_freq_factor"],
            "high_freq_factor": rope["high_freq_factor"],
            "original_max_position_embeddings": rope["original_max_position_embeddings"]})
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if name in drop:
            continue
        array = tensor.to(torch.float32).numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = num_heads if "attn_q" in name else config["num_key_value_heads"]
            array = _permute_for_llama_cpp(array, heads)
        if array.ndim == 2:
            data, qtype = _encode(array, types[matrices % len(types)], rng)
            matrices += 1
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
