"""GGUF checkpoints (llama.cpp's format), as vLLM takes them: `LLM(model="x.gguf")`.

A .gguf file holds the weights, the config (as `<arch>.*` metadata) and usually the tokenizer
and chat template. `prepare_gguf_folder` turns it, once, into a model folder in sluice's cache:
config.json and generation_config.json from the metadata (or config.json from
`--hf-config-path`), the tokenizer as transformers converts it from the metadata (unless
`--tokenizer` names one), and `model.gguf`, a link to the file itself. The rest of the engine
reads that folder like any Hugging Face folder; the loader reads the weights from the link.

Weights are dequantized at load to the engine's dtype by the `gguf` package, tensor by tensor
(peak host memory one tensor in float32). A tensor-parallel rank dequantizes only its rows of a
column-parallel weight (quantization blocks run along a row, so rows slice cleanly); a
row-parallel weight's columns are cut after dequantizing.

llama.cpp stores the query and key weights of `llama` models with each head's rotary halves
interleaved (its RoPE pairs neighbouring elements); the loader undoes that per head, so they are
Hugging Face's again (Qwen's are stored as they are).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_LINK = "model.gguf"

# general.architecture -> the Hugging Face architecture sluice runs it as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

# Tensor types dequantized at load (all through gguf.quants.dequantize).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K",
                          "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# Bump when the prepared folder's contents change, so old cache entries are not reused.
_PREPARE_VERSION = 1


class GGUFError(ValueError):
    """A GGUF file sluice cannot load; the message names the file and, where one is at fault,
    the tensor or metadata key."""


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFError("loading a .gguf checkpoint needs the 'gguf' package: "
                        "pip install gguf") from None
    return gguf


def open_reader(path: str) -> Any:
    """gguf.GGUFReader of `path`, every tensor's type and extent checked first: GGUFError
    naming the tensor for an unsupported type or data past the end of the file."""
    gguf = _import_gguf()
    supported = {gguf.GGMLQuantizationType[name] for name in SUPPORTED_TENSOR_TYPES}

    class Reader(gguf.GGUFReader):
        # The reader keeps the file as an np.memmap and slices it for every metadata value
        # (two slices per token of the vocabulary); slices of a plain ndarray view of the same
        # mapping cost a third as much (no memmap bookkeeping per slice).
        @property
        def data(self) -> np.ndarray:
            return self._file_data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._file_data = mapped.view(np.ndarray)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            names: set[str] = set()
            for field in fields:
                name_data, dims, raw_type, offset = (field.parts[1], field.parts[3],
                                                     field.parts[4], field.parts[5])
                name = bytes(name_data).decode("utf-8", errors="replace")
                if name in names:
                    raise GGUFError(f"GGUF file {path!r} holds tensor {name!r} twice")
                names.add(name)
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    qtype = None
                if qtype not in supported:
                    shown = qtype.name if qtype is not None else f"unknown type {int(raw_type[0])}"
                    raise GGUFError(f"GGUF file {path!r}: tensor {name!r} has type {shown}, "
                                    f"which sluice does not load (supported: "
                                    f"{', '.join(SUPPORTED_TENSOR_TYPES)})")
                block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
                num_elements = int(np.prod(dims))
                if dims.size and int(dims[0]) % block_size:
                    raise GGUFError(f"GGUF file {path!r}: tensor {name!r} of type {qtype.name} "
                                    f"has rows of {int(dims[0])} elements, not a multiple of "
                                    f"its block size {block_size}")
                end = start_offs + int(offset[0]) + num_elements // block_size * type_size
                if end > len(self.data):
                    raise GGUFError(f"GGUF file {path!r} is truncated: tensor {name!r} ends at "
                                    f"byte {end}, the file has {len(self.data)}")
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(path)
    except GGUFError:
        raise
    except (ValueError, IndexError, OSError, UnicodeDecodeError) as exc:
        raise GGUFError(f"GGUF file {path!r} cannot be read (truncated or not a GGUF file?): "
                        f"{type(exc).__name__}: {exc}") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def _require(reader: Any, key: str, path: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFError(f"GGUF file {path!r} has no metadata key {key!r}")
    return value


def hf_config_from_gguf(reader: Any, path: str) -> dict[str, Any]:
    """config.json's fields from the file's metadata (what transformers derives, and head_dim
    from `attention.key_length` where the file gives it)."""
    arch = _require(reader, "general.architecture", path)
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"GGUF file {path!r} has general.architecture {arch!r}, which sluice "
                        f"does not run (supported: {sorted(GGUF_ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str) -> str:
        return f"{arch}.{name}"

    num_heads = int(_require(reader, key("attention.head_count"), path))
    hidden_size = int(_require(reader, key("embedding_length"), path))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = _field(reader, key("vocab_size"))
    if vocab_size is None:
        vocab_size = (len(tokens.data) if tokens is not None
                      else int(tensors["token_embd.weight"].shape[1]))
    head_dim = _field(reader, key("attention.key_length")) or hidden_size // num_heads
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(_require(reader, key("feed_forward_length"), path)),
        "num_hidden_layers": int(_require(reader, key("block_count"), path)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, key("attention.head_count_kv"), num_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_require(reader, key("attention.layer_norm_rms_epsilon"), path)),
        "rope_theta": float(_field(reader, key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": int(_require(reader, key("context_length"), path)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
    }
    for name in ("bos", "eos"):
        token_id = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    if arch == "gemma3":
        # llama.cpp keeps Gemma 3's global RoPE base and window; the local base (10,000), the
        # pattern (a global layer every sixth) and the query scale (the head size) are fixed
        # in its code, as transformers reads them.
        del config["hidden_act"]
        config.update({
            "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
            "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
            "sliding_window": int(_require(reader, key("attention.sliding_window"), path)),
            "query_pre_attn_scalar": int(head_dim), "final_logit_softcapping": None})
    dtype = _weights_dtype(reader)
    if dtype is not None:
        config["torch_dtype"] = dtype
    scaling = _field(reader, key("rope.scaling.type"))
    if scaling not in (None, "none"):
        raise GGUFError(f"GGUF file {path!r} has {key('rope.scaling.type')} = {scaling!r}, "
                        "which sluice does not run; give the model's config.json with "
                        "--hf-config-path")
    if "rope_freqs.weight" in tensors:
        config["rope_scaling"] = _llama3_rope_scaling(
            reader, tensors["rope_freqs.weight"], config, path)
    return config


def _weights_dtype(reader: Any) -> str | None:
    """float16 / bfloat16 when every matrix is stored so; None (float32) otherwise."""
    names = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    if names == {"F16"}:
        return "float16"
    if names == {"BF16"}:
        return "bfloat16"
    return None


def _llama3_rope_scaling(reader: Any, tensor: Any, config: dict[str, Any],
                         path: str) -> dict[str, Any]:
    """llama.cpp keeps Llama 3.1's RoPE scaling as per-frequency divisors (rope_freqs); the
    llama3 parameters that give those divisors, searched over the values models use (factor a
    power of two, low / high frequency factors 1 / 4 or 1 / 8 or 2 / 8, a power-of-two original
    context)."""
    from sluice.model.layers import rope_inv_freq

    gguf = _import_gguf()
    stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
    theta, head_dim = config["rope_theta"], config["head_dim"]
    plain = rope_inv_freq(head_dim, theta).numpy()
    factor = float(stored.max())
    for low, high in ((1.0, 4.0), (1.0, 8.0), (2.0, 8.0)):
        for original in (2**k for k in range(7, 18)):
            params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                      "high_freq_factor": high, "original_max_position_embeddings": original}
            divisors = plain / rope_inv_freq(head_dim, theta, params).numpy()
            if divisors.shape == stored.shape and np.allclose(divisors, stored, rtol=1e-4):
                return params
    raise GGUFError(f"GGUF file {path!r}: tensor 'rope_freqs.weight' holds RoPE frequency "
                    "factors of no llama3 scaling sluice knows; give the model's config.json "
                    "with --hf-config-path")


def _hf_tensor_names(config: dict[str, Any]) -> list[str]:
    """Every tensor name a Hugging Face checkpoint of `config` may have."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names += [f"{prefix}.self_attn.{proj}.weight", f"{prefix}.self_attn.{proj}.bias"]
        names += [f"{prefix}.self_attn.q_norm.weight", f"{prefix}.self_attn.k_norm.weight",
                  f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"]
        names += [f"{prefix}.pre_feedforward_layernorm.weight",
                  f"{prefix}.post_feedforward_layernorm.weight"]  # Gemma 3
        names += [f"{prefix}.mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
    return names


def gguf_to_hf_names(arch: str, config: dict[str, Any]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, through the gguf package's name tables."""
    gguf = _import_gguf()
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    mapping = {}
    for hf_name in _hf_tensor_names(config):
        gguf_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            mapping[gguf_name] = hf_name
    return mapping


class GGUFTensor:
    """One tensor of a GGUF file, dequantized on demand; the interface of
    sluice.model.weights.CheckpointTensor (shape, narrow, read)."""

    def __init__(self, tensor: Any, dtype: torch.dtype, unpermute_heads: int | None,
                 offset: float = 0.0) -> None:
        self._tensor = tensor
        self._offset = offset  # added to every value (Gemma's norm gains: -1)
        self.file_name = tensor.name  # llama.cpp's name, for errors
        self._dtype = dtype
        # GGUF lists dimensions innermost first; torch's order is the reverse.
        self.shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        self._heads = unpermute_heads  # llama's q / k: heads whose halves to de-interleave

    def read(self) -> torch.Tensor:
        return self._rows(0, self.shape[0] if self.shape else 1)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0 and self._heads is None:
            return self._rows(start, length)
        if dim == 0 and (start % self._head_size() == 0 and length % self._head_size() == 0):
            return self._rows(start, length)
        return self.read().narrow(dim, start, length)

    def _head_size(self) -> int:
        return self.shape[0] // self._heads

    def _rows(self, start: int, length: int) -> torch.Tensor:
        gguf = _import_gguf()
        data = self._tensor.data
        if len(self.shape) > 1:  # quantization blocks run along a row: rows slice whole
            data = data[start:start + length]
        values = gguf.quants.dequantize(np.ascontiguousarray(data), self._tensor.tensor_type)
        tensor = torch.from_numpy(np.asarray(values, dtype=np.float32).copy())
        if len(self.shape) > 1:
            tensor = tensor.reshape(length, *self.shape[1:])
        else:  # a vector (a bias): dequantized whole, then cut
            tensor = tensor.reshape(self.shape)[start:start + length]
        if self._heads is not None:
            # llama.cpp's order within a head: (pairs, 2); Hugging Face's: (2, pairs).
            head_size = self._head_size()
            tensor = (tensor.reshape(length // head_size, head_size // 2, 2, -1)
                      .transpose(1, 2).reshape(length, *self.shape[1:]))
        if self._offset:
            tensor = tensor + self._offset
        return tensor.to(self._dtype)


def iterate_gguf_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, GGUFTensor]]:
    """(Hugging Face name, tensor not read yet) for every weight of the GGUF file."""
    reader = open_reader(path)
    config = hf_config_from_gguf(reader, path)
    arch = _require(reader, "general.architecture", path)
    names = gguf_to_hf_names(arch, config)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # read into config.json's rope_scaling (hf_config_from_gguf)
        hf_name = names.get(tensor.name)
        if hf_name is None:
            raise GGUFError(f"GGUF file {path!r}: tensor {tensor.name!r} has no place in a "
                            f"{arch} model")
        unpermute = None
        if arch == "llama" and hf_name.endswith(".weight"):
            unpermute = heads.get(hf_name.split(".")[-2])
        # llama.cpp stores Gemma's (1 + w) norm gains; the checkpoint's w is one less
        offset = -1.0 if arch == "gemma3" and hf_name.endswith("norm.weight") else 0.0
        yield hf_name, GGUFTensor(tensor, dtype, unpermute, offset)


def _cache_key(path: str, hf_config_path: str | None, tokenizer: str | None,
               chat_template: str | None) -> str:
    stat = os.stat(path)
    digest = hashlib.sha256()
    digest.update(json.dumps([_PREPARE_VERSION, os.path.realpath(path), stat.st_size,
                              stat.st_mtime_ns, tokenizer is None, chat_template]).encode())
    if hf_config_path is not None:
        digest.update(Path(hf_config_path, "config.json").read_bytes())
    return digest.hexdigest()[:16]


def prepare_gguf_folder(path: str, cache_dir: str, hf_config_path: str | None = None,
                        tokenizer: str | None = None, chat_template: str | None = None) -> str:
    """The model folder of the GGUF file `path` (see the module), built once under
    `cache_dir`; `tokenizer` given: the folder has no tokenizer of its own; `chat_template`:
    the tokenizer's chat template instead of the file's."""
    if not os.path.isfile(path):
        raise ValueError(f"model {path!r}: no such GGUF file")
    if hf_config_path is not None and not os.path.isfile(
            os.path.join(hf_config_path, "config.json")):
        raise ValueError(f"hf_config_path {hf_config_path!r} is not a folder with a "
                         "config.json")
    stem = Path(path).stem
    key = _cache_key(path, hf_config_path, tokenizer, chat_template)
    target = Path(cache_dir) / "gguf" / f"{stem}-{key}"
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{stem}-", dir=target.parent))
    try:
        _write_folder(path, staging, hf_config_path, tokenizer is None, chat_template)
        try:
            os.replace(staging, target)
        except OSError:  # another process put its complete copy in place first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _write_folder(path: str, out: Path, hf_config_path: str | None, with_tokenizer: bool,
                  chat_template: str | None) -> None:
    os.symlink(os.path.realpath(path), out / GGUF_LINK)
    reader = open_reader(path)
    config = hf_config_from_gguf(reader, path)
    if hf_config_path is not None:
        shutil.copyfile(os.path.join(hf_config_path, "config.json"), out / "config.json")
        generation = os.path.join(hf_config_path, "generation_config.json")
        if os.path.isfile(generation):
            shutil.copyfile(generation, out / "generation_config.json")
    else:
        (out / "config.json").write_text(json.dumps(config, indent=2))
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if not with_tokenizer:
        return
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise GGUFError(f"GGUF file {path!r} has no tokenizer (no tokenizer.ggml.tokens); "
                        "give one with --tokenizer")
    del reader  # transformers opens the file again
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    try:
        converted = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        raise GGUFError(f"GGUF file {path!r}: transformers cannot build its tokenizer "
                        f"({type(exc).__name__}: {exc}); give one with --tokenizer") from None
    if chat_template is not None:
        converted.chat_template = chat_template
    converted.save_pretrained(str(out))
