"""Build a model on its device and stream Hugging Face safetensors weights (or a GGUF file's,
sluice.model.gguf_loader) into it.

Weights go tensor by tensor from `safe_open` into the parameters' `weight_loader`s, so peak host
memory is one tensor, not the checkpoint; each loader reads only its part of the file (a
tensor-parallel rank its rows or columns: sluice.model.weights.CheckpointTensor).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sluice.attention.backend import AttentionBackend
from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.attention import name_attention_layers
from sluice.model.gguf_loader import GGUF_LINK, iterate_gguf_weights
from sluice.model.hf_config import HFModelConfig
from sluice.model.quantization import Fp8CheckpointTensor, Fp8Config
from sluice.model.registry import get_model_class
from sluice.model.weights import CheckpointTensor, LoadedWeight, default_weight_loader

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str, hf_config: HFModelConfig) -> torch.dtype:
    """"auto" takes config.json's dtype (float32 when it names none)."""
    if dtype == "auto":
        name = hf_config.torch_dtype or "float32"
        if name not in _DTYPES:
            raise ValueError(f"config.json dtype must be one of {list(_DTYPES)}, got {name!r}")
        return _DTYPES[name]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {dtype!r}")
    return _DTYPES[dtype]


def load_model(
    model_dir: str,
    hf_config: HFModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend,
    tp: TPGroup = SINGLE_RANK,
    fp8_weights: bool | None = None,
) -> nn.Module:
    """The model of `hf_config.architectures`, in eval mode, weights from `model_dir`; at
    tp.size > 1 this rank's shard of it. An FP8 checkpoint's projections keep their FP8
    weights when `fp8_weights` (None: `fp8_weights_kept`), else they are dequantized to
    `dtype` at load."""
    weights = checkpoint_weights(model_dir, dtype, hf_config.quantization)
    model_class = get_model_class(hf_config.architectures)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(hf_config, attn_backend, tp)
    finally:
        torch.set_default_dtype(previous_dtype)
    name_attention_layers(model)
    if fp8_weights is None:
        fp8_weights = fp8_weights_kept(device)
    if (hf_config.quantization is not None and fp8_weights
            and getattr(model, "fp8_weights", True)
            and not os.path.lexists(os.path.join(model_dir, GGUF_LINK))):
        from sluice.model.moe import prepare_fp8_experts

        fp8_names = fp8_weight_names(safetensors_files(model_dir))
        kept, layers = prepare_fp8_layers(model, hf_config.quantization, fp8_names,
                                          getattr(model, "packed_modules", {}))
        kept_moe, moe_layers = prepare_fp8_experts(model, hf_config.quantization, fp8_names)
        logger.info("FP8 checkpoint (%s): %d of %d linear layers and %d of %d expert layers "
                    "keep FP8 weights and multiply in FP8, the rest are dequantized to %s",
                    hf_config.quantization.describe(), kept, layers, kept_moe, moe_layers,
                    dtype)
    with torch.no_grad():
        model.load_weights(weights)
    return model.eval().requires_grad_(False)


def fp8_matmuls_supported(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 on its tensor cores: CUDA compute capability 8.9 (Ada)
    and up."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_weights_kept(device: torch.device) -> bool:
    """Whether the projections of an FP8 checkpoint keep their FP8 weights on `device`: the
    environment's SLUICE_FP8_WEIGHTS, "auto" (the default: where fp8_matmuls_supported),
    "keep" (also elsewhere: the CPU multiplies by dequantizing per step, for tests) or
    "dequantize" (never: the weights dequantized at load, 16-bit matmuls)."""
    choice = os.environ.get("SLUICE_FP8_WEIGHTS", "auto")
    if choice not in ("auto", "keep", "dequantize"):
        raise ValueError(f"SLUICE_FP8_WEIGHTS must be 'auto', 'keep' or 'dequantize', got "
                         f"{choice!r}")
    return choice == "keep" or (choice == "auto" and fp8_matmuls_supported(device))


def fp8_weight_names(files: list[str]) -> set[str]:
    """The names of the FP8 tensors of safetensors `files` (read from their headers)."""
    names = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names.update(name for name in f.keys()
                         if f.get_slice(name).get_dtype().startswith("F8"))
    return names


def prepare_fp8_layers(model: nn.Module, quantization: Fp8Config, fp8_names: set[str],
                       packed_modules: dict[str, tuple[str, str | int]]) -> tuple[int, int]:
    """Make each linear layer of `model` whose checkpoint weights are all FP8 (every tensor a
    merged layer stacks, `packed_modules`) hold FP8 weights and scales (Linear.use_fp8), where
    this rank's pieces fall on the scale blocks (Linear.fp8_fits); the others load
    dequantized. Returns (layers made FP8, linear layers)."""
    from sluice.model.linear import Linear

    stacked: dict[str, list[str]] = {}
    for checkpoint_module, (model_module, _) in packed_modules.items():
        stacked.setdefault(model_module, []).append(checkpoint_module)
    block = quantization.block_size if quantization.scheme == "block" else None
    kept = layers = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        layers += 1
        prefix, _, leaf = name.rpartition(".")
        sources = [f"{prefix}.{source}" if prefix else source
                   for source in stacked.get(leaf, [leaf])]
        if all(f"{source}.weight" in fp8_names for source in sources) and module.fp8_fits(block):
            module.use_fp8(block)
            kept += 1
    return kept, layers


def checkpoint_weights(model_dir: str, dtype: torch.dtype,
                       quantization: Fp8Config | None = None
                       ) -> Iterator[tuple[str, LoadedWeight]]:
    """The folder's weights, HF-named: its safetensors files (FP8 ones dequantized to `dtype`
    where config.json's `quantization` says how), or the GGUF file of a folder made by
    sluice.model.gguf_loader.prepare_gguf_folder."""
    gguf_path = os.path.join(model_dir, GGUF_LINK)
    if os.path.lexists(gguf_path):
        return iterate_gguf_weights(gguf_path, dtype)
    return iterate_weights(safetensors_files(model_dir), dtype, quantization)


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files: the shards of model.safetensors.index.json, else model.safetensors,
    else every *.safetensors in the folder."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model folder {model_dir!r} does not exist")
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        paths = [os.path.join(model_dir, shard) for shard in shards]
        for shard, path in zip(shards, paths):
            if not os.path.isfile(path):
                raise ValueError(
                    f"shard {shard!r} listed in {index_path!r} is missing from {model_dir!r}"
                )
        return paths
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not paths:
        raise ValueError(f"model folder {model_dir!r} has no *.safetensors weights")
    return paths


def iterate_weights(files: list[str], dtype: torch.dtype,
                    quantization: Fp8Config | None = None
                    ) -> Iterator[tuple[str, LoadedWeight]]:
    """(HF name, tensor not read yet) for every tensor of `files`, floating point ones to be
    cast to `dtype`; each is valid until the iteration moves past its file. With
    `quantization`, an FP8 weight comes with its scale (read from whichever file holds it) as an
    Fp8CheckpointTensor, and the scale tensors themselves are not yielded."""
    if quantization is None:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if f.get_slice(name).get_dtype().startswith("F8"):
                        raise ValueError(
                            f"checkpoint tensor {name!r} is FP8 but config.json has no "
                            "quantization_config saying how it is scaled")
                    yield name, CheckpointTensor(f, name, dtype)
        return
    yield from _iterate_fp8_weights(files, dtype, quantization)


_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")


def _iterate_fp8_weights(files: list[str], dtype: torch.dtype,
                         quantization: Fp8Config) -> Iterator[tuple[str, LoadedWeight]]:
    index: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            index.update((name, path) for name in f.keys())
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def handle(path: str) -> Any:
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt",
                                                              device="cpu"))
            return handles[path]

        for path in files:
            f = handle(path)
            for name in f.keys():
                if name.endswith(_SCALE_SUFFIXES):
                    module = name.rsplit(".", 1)[0]
                    if module + ".weight" not in index:
                        raise ValueError(f"checkpoint tensor {name!r} scales no weight: "
                                         f"{module + '.weight'!r} is not in the checkpoint")
                    continue
                weight = f.get_slice(name)
                if not weight.get_dtype().startswith("F8"):
                    yield name, CheckpointTensor(f, name, dtype)
                    continue
                module = name.removesuffix(".weight")
                if weight.get_dtype() != "F8_E4M3" or not name.endswith(".weight"):
                    raise ValueError(f"checkpoint tensor {name!r} is {weight.get_dtype()}: "
                                     "only float8_e4m3fn weights are read")
                if quantization.is_ignored(module):
                    raise ValueError(f"{module!r} is left unquantized by config.json's "
                                     f"quantization_config, but its weight {name!r} is FP8")
                scale_name = f"{module}.{quantization.scale_name}"
                if scale_name not in index:
                    raise ValueError(f"FP8 weight {name!r} has no scale: {scale_name!r} is not "
                                     f"in the checkpoint ({quantization.describe()})")
                if (quantization.activations == "static"
                        and f"{module}.input_scale" not in index):
                    raise ValueError(f"FP8 weight {name!r} has no {module + '.input_scale'!r}, "
                                     "which static activation quantization needs")
                scale = handle(index[scale_name]).get_tensor(scale_name)
                yield name, Fp8CheckpointTensor(name, weight, scale, quantization, dtype)


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, LoadedWeight]],
    packed_modules: dict[str, tuple[str, str | int]],
    skip: tuple[str, ...] = (),
    loaded_elsewhere: set[str] = frozenset(),
) -> None:
    """Load HF-named tensors into `model`, merging those `packed_modules` names.

    packed_modules: checkpoint module name -> (model module name, shard id), e.g.
        {"q_proj": ("qkv_proj", "q"), "gate_proj": ("gate_up_proj", 0)}.
    skip: checkpoint names to ignore (e.g. rotary `inv_freq`, a tied `lm_head.weight`).
    loaded_elsewhere: parameters filled by another loader (the experts of sluice.model.moe).
    Every checkpoint tensor must find a parameter and every parameter (every shard of a merged
    one) must be loaded; a tied parameter shows up once, under its first name.
    """
    params = dict(model.named_parameters())
    expected: set[tuple[str, str | int | None]] = set()
    for param_name in params:
        if param_name in loaded_elsewhere:
            continue
        module_name = param_name.split(".")[-2] if "." in param_name else ""
        shards = [sid for target, sid in packed_modules.values() if target == module_name]
        expected.update((param_name, sid) for sid in shards or [None])

    loaded: set[tuple[str, str | int | None]] = set()
    for name, tensor in weights:
        if any(name.endswith(suffix) for suffix in skip):
            continue
        param_name, shard_id = name, None
        for ckpt_module, (model_module, sid) in packed_modules.items():
            if f".{ckpt_module}." in name:
                param_name = name.replace(f".{ckpt_module}.", f".{model_module}.", 1)
                shard_id = sid
                break
        param = params.get(param_name)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {name!r} has no destination in {type(model).__name__}"
            )
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, tensor, shard_id)
        except ValueError as e:
            stored_as = getattr(tensor, "file_name", None)  # a GGUF tensor's own name
            where = f" (stored as {stored_as!r})" if stored_as else ""
            raise ValueError(
                f"cannot load checkpoint tensor {name!r}{where} into {param_name!r}: {e}"
            ) from None
        loaded.add((param_name, shard_id))

    missing = sorted(
        name if sid is None else f"{name} (shard {sid!r})" for name, sid in expected - loaded
    )
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        shown = ", ".join(missing[:8]) + more
        raise ValueError(f"parameters of {type(model).__name__} not in the checkpoint: {shown}")
