"""FP8 checkpoints: the `quantization_config` of config.json, and their weights read back.

Two families are read, as Qwen, DeepSeek and RedHat ship them:

- `"quant_method": "fp8"` (Qwen3-*-FP8, DeepSeek style). With `"weight_block_size": [128, 128]`:
  float8_e4m3fn weights with a float32 `weight_scale_inv` per block of 128 x 128
  (weight = fp8 * scale_inv). Without a block size: one `weight_scale` per tensor. Activations are
  quantized per token (block: per token and 128-channel group) at run time
  (`"activation_scheme": "dynamic"`), or with a stored `input_scale` (`"static"`). Modules named
  in `ignored_layers` / `modules_to_not_convert` stay in the checkpoint dtype.
- `"quant_method": "compressed-tensors"` with `"format": "float-quantized"` (llm-compressor's
  "FP8-dynamic" / "FP8" checkpoints). One config group of 8-bit float weights with strategy
  "channel" (`weight_scale` [N, 1]), "tensor" (`weight_scale` [1]) or "block"; activations
  dynamic per token, or static per tensor (`input_scale`). `ignore` lists module names or
  `re:` patterns (`lm_head` in every one seen).

Any other method (AWQ, GPTQ, bitsandbytes, NVFP4 and other compressed-tensors schemes) is
refused at start with a message naming it. The config is parsed by sluice.model.quant_config,
which imports no torch (the API server reads model configs before the engine core loads it).

How the engine runs them (`Fp8CheckpointTensor`, read tensor by tensor, a tensor-parallel rank
reading only its rows or columns and their scales):
- On a GPU with FP8 tensor cores (compute capability 8.9 and up) the decoder's projections keep
  their FP8 weights and scales (sluice.model.linear: `Linear.use_fp8`, chosen per layer by
  `prepare_fp8_layers`) and multiply in FP8 (sluice.model.fp8_gemm); so do the experts of a
  mixture of experts (sluice.model.moe: `FusedMoE.use_fp8`, `prepare_fp8_experts`; the W8A16
  kernels of sluice.model.triton_moe).
- Elsewhere (the CPU, older GPUs), and for a layer whose shards do not fall on scale blocks,
  the weights are dequantized at load into the compute dtype, so the matmuls are the dtype's
  own: the reference the tests check the FP8 kernels against (`fp8_linear_reference` is the
  same product for a layer holding FP8 weights).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from sluice.model.quant_config import (  # noqa: F401 (re-exported)
    Fp8Config,
    parse_quantization_config,
    quantization_config_for,
)

FP8_MAX = 448.0  # largest float8_e4m3fn value


# ---- reading the weights ---------------------------------------------------------------------


def dequantize(weight: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
               dtype: torch.dtype, row_offset: int = 0, col_offset: int = 0) -> torch.Tensor:
    """weight (float8, a [rows, columns] piece of the full tensor starting at (row_offset,
    col_offset), block-aligned for scheme "block") times its scale(s), in float32, cast to
    `dtype`. `scale` is the piece's: block: [ceil(rows / br), ceil(cols / bc)] blocks; channel:
    [rows, 1]; tensor: one value."""
    if config.scheme == "block":
        br, bc = config.block_size
        assert row_offset % br == 0 and col_offset % bc == 0, "pieces start on a block"
        return dequantize_stored(weight, scale, config.block_size, dtype)
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if config.scheme == "channel":
        s = s.reshape(-1, 1) if w.dim() == 2 else s.reshape(-1)
    else:
        s = s.reshape(())
    return (w * s).to(dtype)


def dequantize_stored(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """A layer's FP8 weight [N, K] as sluice.model.linear stores it (scale: per `block`
    [ceil(N / br), ceil(K / bc)], or per row [N] when `block` is None) -> weight * scale in
    float32, cast to `dtype`."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block is None:
        return (w * s.reshape(-1, 1)).to(dtype)
    br, bc = block
    s = s.repeat_interleave(br, 0)[: w.shape[0]].repeat_interleave(bc, 1)[:, : w.shape[1]]
    return (w * s).to(dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int] | None) -> torch.Tensor:
    """x W^T for a layer's FP8 weight: the weight dequantized to x's dtype (as the load-time
    path does), then F.linear. The CPU path, and the reference of sluice.model.fp8_gemm."""
    return torch.nn.functional.linear(x, dequantize_stored(weight, scale, block, x.dtype))


class Fp8CheckpointTensor:
    """An FP8 weight of a checkpoint with its scale, read on demand and dequantized to `dtype`:
    the interface of sluice.model.weights.CheckpointTensor (`shape`, `narrow`, `read`), so a
    tensor-parallel rank reads its rows or columns of the weight and of the scale alone."""

    def __init__(self, name: str, weight: Any, scale: torch.Tensor, config: Fp8Config,
                 dtype: torch.dtype) -> None:
        """weight: a safetensors slice (`get_slice`) or a tensor; scale: the whole scale
        tensor (small: 1.5k values for Qwen3-8B's gate_up_proj in 128 x 128 blocks)."""
        self.name = name
        self._weight = weight
        self._scale = scale
        self._config = config
        self._dtype = dtype
        self.shape = tuple(_shape(weight))
        self._check_scale()

    def _check_scale(self) -> None:
        scale_shape = tuple(_shape(self._scale))
        scheme = self._config.scheme
        if len(self.shape) != 2:
            raise ValueError(f"FP8 weight {self.name!r} has shape {list(self.shape)}: a matrix "
                             "is expected")
        rows, cols = self.shape
        if scheme == "block":
            br, bc = self._config.block_size
            expected = [(-(-rows // br), -(-cols // bc))]
        elif scheme == "channel":
            expected = [(rows, 1), (rows,)]
        else:
            expected = [(), (1,)]
        if scale_shape not in expected:
            raise ValueError(
                f"scale of FP8 weight {self.name!r} has shape {list(scale_shape)}; per "
                f"{scheme} a {list(self.shape)} weight needs {list(expected[0])}")

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length), dequantized."""
        if self._config.scheme != "block":
            w = _read(self._weight, dim, start, start + length)
            scale = (_read(self._scale, 0, start, start + length)
                     if self._config.scheme == "channel" and dim == 0 else _read_all(self._scale))
            return dequantize(w, scale, self._config, self._dtype)
        block = self._config.block_size[dim]
        first = start // block * block
        end = min(self.shape[dim], -(-(start + length) // block) * block)
        w = _read(self._weight, dim, first, end)
        scale = _read(self._scale, dim, first // block, -(-end // block))
        full = dequantize(w, scale, self._config, self._dtype,
                          row_offset=first if dim == 0 else 0,
                          col_offset=first if dim == 1 else 0)
        return full.narrow(dim, start - first, length)

    def read(self) -> torch.Tensor:
        return dequantize(_read_all(self._weight), _read_all(self._scale), self._config,
                          self._dtype)

    # -- for a layer that keeps the FP8 weights (sluice.model.linear.Linear.use_fp8) --

    def narrow_fp8(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length) of the FP8 weight as is."""
        return _read(self._weight, dim, start, start + length)

    def stored_scale(self, dim: int, start: int, length: int) -> torch.Tensor:
        """The float32 scales of narrow_fp8(dim, start, length) in a layer's layout: per block,
        [block rows, block columns] of the piece (which must start on a block and end on one
        or at the tensor's end); per row otherwise, [rows] (a per-tensor scale repeated)."""
        scheme = self._config.scheme
        scale = _read_all(self._scale).to(torch.float32)
        rows = length if dim == 0 else self.shape[0]
        if scheme == "tensor":
            return scale.reshape(1).expand(rows).contiguous()
        if scheme == "channel":
            scale = scale.reshape(-1)
            return scale[start : start + length].clone() if dim == 0 else scale.clone()
        block = self._config.block_size[dim]
        end = start + length
        if start % block or (end % block and end != self.shape[dim]):
            raise ValueError(f"{self.name!r}: {['rows', 'columns'][dim]} [{start}, {end}) "
                             f"do not fall on its {block}-wide scale blocks")
        return _read(scale, dim, start // block, -(-end // block)).clone()


def _shape(tensor: Any) -> list[int]:
    return list(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor.get_shape()


def _read(tensor: Any, dim: int, start: int, end: int) -> torch.Tensor:
    index = (slice(None),) * dim + (slice(start, end),)
    return tensor[index]


def _read_all(tensor: Any) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


# ---- writing them (sluice make-model --quantize) ------------------------------------------


def quantize_fp8(weight: torch.Tensor, scheme: str,
                 block_size: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight -> (float8_e4m3fn weight, float32 scale) with weight ~= fp8 * scale:
    per block (scale [ceil(N / br), ceil(K / bc)]), per output channel ([N, 1]) or per tensor
    ([1]); each scale maps its part's largest magnitude to FP8_MAX."""
    w = weight.to(torch.float32)
    n, k = w.shape
    if scheme == "block":
        br, bc = block_size
        rows, cols = -(-n // br), -(-k // bc)
        padded = torch.zeros(rows * br, cols * bc, device=w.device)
        padded[:n, :k] = w
        amax = padded.reshape(rows, br, cols, bc).abs().amax(dim=(1, 3))
        scale = amax.clamp(min=1e-12) / FP8_MAX
        expanded = scale.repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]
    elif scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        expanded = scale
    elif scheme == "tensor":
        scale = (w.abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(1)
        expanded = scale
    else:
        raise ValueError(f"FP8 scheme must be 'block', 'channel' or 'tensor', got {scheme!r}")
    quantized = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, scale.to(torch.float32)


# What quantize_weights stores as FP8: the decoder's projections (attention, a dense MLP,
# Qwen2-MoE's shared expert) and every expert of a mixture of experts, named as Qwen's FP8 and
# RedHat's FP8-dynamic checkpoints name them (`mlp.experts.{e}.{gate,up,down}_proj`; Mixtral's
# `block_sparse_moe.experts.{e}.w1/w2/w3`). Routers (`mlp.gate`, `block_sparse_moe.gate`,
# `shared_expert_gate`) stay in the checkpoint dtype, as in those checkpoints.
_PROJECTION = re.compile(
    r"(.*\.)?layers\.\d+\.(self_attn\.[qkvo]_proj"
    r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
# Routers, and compressed-tensors' `ignore` patterns for them (RedHat's MoE checkpoints list
# the router so: only Linear layers not ignored are quantized).
_ROUTERS = {r"\.mlp\.gate\.weight$": "re:.*mlp\\.gate$",
            r"\.block_sparse_moe\.gate\.weight$": "re:.*block_sparse_moe\\.gate$",
            r"\.mlp\.shared_expert_gate\.weight$": "re:.*mlp\\.shared_expert_gate$"}


def quantize_weights(weights: dict[str, torch.Tensor], choice: str,
                     block_size: tuple[int, int] = (128, 128)
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An HF-named state dict -> (the same with the decoder's projections and experts as FP8
    and their scales added, config.json's quantization_config) for `choice` "fp8-block"
    (quant_method fp8, per block) or "fp8-channel" (compressed-tensors, per output channel);
    embeddings, norms, routers and the lm_head are kept. For sluice make-model --quantize,
    quantize_folder and the accuracy tool."""
    scheme, config = quantization_config_for(choice, block_size)
    scale_name = "weight_scale_inv" if scheme == "block" else "weight_scale"
    out = dict(weights)
    for name in [n for n in weights if _PROJECTION.match(n)]:
        out[name], out[name.removesuffix("weight") + scale_name] = quantize_fp8(
            weights[name], scheme, block_size)
    if "ignore" in config:
        config["ignore"] += [pattern for router, pattern in _ROUTERS.items()
                             if any(re.search(router, n) for n in weights)]
    return out, config


def quantize_folder(src: str, dst: str, choice: str, block_size: tuple[int, int] = (128, 128),
                    device: str = "cpu") -> None:
    """Write an FP8 copy of safetensors model folder `src` to `dst` (quantize_weights, one
    shard at a time on `device`; the other files copied, the shard index rewritten), for
    benchmarks/tools/quantize_folder.py and the tests' MoE checkpoints."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    source, target = Path(src), Path(dst)
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(path, target / path.name)
    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"model folder {src!r} has no *.safetensors weights")
    weight_map: dict[str, str] = {}
    ignored: list[str] = []  # each shard's routers' patterns (compressed-tensors)
    for shard in shards:
        tensors = {name: t.to(device) for name, t in load_file(str(shard)).items()}
        quantized, quantization_config = quantize_weights(tensors, choice, block_size)
        ignored += [p for p in quantization_config.get("ignore", []) if p not in ignored]
        save_file({name: t.contiguous().cpu() for name, t in quantized.items()},
                  str(target / shard.name), metadata={"format": "pt"})
        weight_map.update((name, shard.name) for name in quantized)
        del tensors, quantized
    if "ignore" in quantization_config:
        quantization_config["ignore"] = ignored
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config, indent=1))
    if (source / "model.safetensors.index.json").exists():
        (target / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
