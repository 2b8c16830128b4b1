"""config.json's `quantization_config` for FP8 checkpoints, parsed without importing torch (the
API server reads model configs before the engine core imports it). What the formats are and how
their weights are read: sluice.model.quantization."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Methods refused with a pointer to what they are (the message names the method either way).
_KNOWN_UNSUPPORTED = {
    "awq": "int4 AWQ", "gptq": "int4/int8 GPTQ", "gptq_marlin": "GPTQ (Marlin)",
    "awq_marlin": "AWQ (Marlin)", "bitsandbytes": "bitsandbytes", "modelopt": "NVIDIA ModelOpt",
    "modelopt_fp4": "NVFP4 (ModelOpt)", "mxfp4": "MXFP4", "gguf": "GGUF (load the .gguf file)",
    "fbgemm_fp8": "FBGEMM FP8", "hqq": "HQQ", "eetq": "EETQ", "torchao": "torchao",
}


@dataclass(frozen=True, slots=True)
class Fp8Config:
    method: str  # "fp8" | "compressed-tensors"
    scheme: str  # weights: "block" | "channel" | "tensor"
    block_size: tuple[int, int] | None  # scheme "block": (rows, columns) of a scale's block
    activations: str  # "dynamic" (per token, or per token and group for blocks) | "static" | "none"
    ignored: tuple[str, ...]  # module names, or "re:" patterns (compressed-tensors)

    @property
    def scale_name(self) -> str:
        """The suffix of a weight's scale: `X.weight` is scaled by `X.<scale_name>`."""
        return "weight_scale_inv" if self.method == "fp8" and self.scheme == "block" else (
            "weight_scale")

    def is_ignored(self, module_name: str) -> bool:
        """Whether the module (e.g. "model.layers.0.mlp.down_proj", "lm_head") stays
        unquantized."""
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module_name):
                    return True
            elif module_name == pattern or module_name.endswith("." + pattern):
                return True
        return False

    def describe(self) -> str:
        block = f" {self.block_size[0]}x{self.block_size[1]}" if self.block_size else ""
        return (f"{self.method} FP8 (e4m3) weights per {self.scheme}{block}, "
                f"{self.activations} activations")


def parse_quantization_config(raw: Any) -> Fp8Config | None:
    """config.json's `quantization_config` -> Fp8Config, None without one; ValueError naming
    the method or field for anything not read here."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "fp8":
        return _parse_fp8(raw)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    what = _KNOWN_UNSUPPORTED.get(str(method).lower())
    raise ValueError(
        f"quantization method {method!r}{f' ({what})' if what else ''} is not supported; "
        "sluice reads FP8 checkpoints: quant_method 'fp8' (per block or per tensor) and "
        "'compressed-tensors' float-quantized (per channel, tensor or block)")


def _parse_fp8(raw: dict[str, Any]) -> Fp8Config:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 quantization_config fmt {fmt!r} is not supported (allowed: 'e4m3')")
    activations = raw.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme must be 'dynamic' or 'static', got "
                         f"{activations!r}")
    block = raw.get("weight_block_size")
    if block is not None:
        block = _block_size(block, "weight_block_size")
        if activations != "dynamic":
            raise ValueError("fp8 weight_block_size needs activation_scheme 'dynamic', got "
                             f"{activations!r}")
    ignored = [*(raw.get("ignored_layers") or []), *(raw.get("modules_to_not_convert") or [])]
    return Fp8Config("fp8", "block" if block else "tensor", block, activations,
                     tuple(str(x) for x in ignored))


def _block_size(value: Any, what: str) -> tuple[int, int]:
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"{what} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _parse_compressed_tensors(raw: dict[str, Any]) -> Fp8Config:
    fmt = raw.get("format")
    groups = raw.get("config_groups") or {}
    if fmt != "float-quantized" or len(groups) != 1:
        raise ValueError(
            f"compressed-tensors format {fmt!r} with {len(groups)} config group(s) is not "
            "supported (allowed: 'float-quantized', one group of FP8 weights)")
    (name, group), = groups.items()
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(
            f"compressed-tensors group {name!r} has {weights.get('num_bits')}-bit "
            f"{weights.get('type')} weights: not supported (allowed: 8-bit float)")
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(f"compressed-tensors group {name!r} targets {targets!r}: not supported "
                         "(allowed: ['Linear'])")
    if weights.get("symmetric") is False or weights.get("dynamic"):
        raise ValueError(f"compressed-tensors group {name!r}: asymmetric or dynamic weight "
                         "scales are not supported")
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        block = _block_size(weights.get("block_structure"), "block_structure")
    elif strategy not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported "
                         "(allowed: 'channel', 'tensor', 'block')")
    inputs = group.get("input_activations")
    if inputs is None:
        activations = "none"
    else:
        if inputs.get("type") != "float" or inputs.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors group {name!r} quantizes activations to "
                             f"{inputs.get('num_bits')}-bit {inputs.get('type')}: not supported")
        activations = "dynamic" if inputs.get("dynamic") else "static"
        allowed = ("token", "group") if activations == "dynamic" else ("tensor",)
        if inputs.get("strategy") not in allowed:
            raise ValueError(
                f"compressed-tensors {activations} input activations with strategy "
                f"{inputs.get('strategy')!r} are not supported (allowed: {list(allowed)})")
    return Fp8Config("compressed-tensors", strategy, block, activations,
                     tuple(str(x) for x in raw.get("ignore") or []))


# make-model's --quantize choices: (scheme, config.json's quantization_config)
def quantization_config_for(choice: str, block_size: tuple[int, int] = (128, 128)
                            ) -> tuple[str, dict[str, Any]]:
    if choice == "fp8-block":
        return "block", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": list(block_size), "ignored_layers": ["lm_head"]}
    if choice == "fp8-channel":
        return "channel", {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True}}},
            "ignore": ["lm_head"]}
    raise ValueError(f"--quantize must be 'fp8-block' or 'fp8-channel', got {choice!r}")
