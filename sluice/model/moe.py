"""A mixture-of-experts MLP (Qwen3-MoE's sparse block): a router picks `top_k` of `num_experts`
SwiGLU experts per token and the block returns their outputs weighted by the router's softmax.

Each layer's experts are two stacked parameters, `w13` [E, 2 I_r, H] (each expert's gate rows then
up rows) and `w2` [E, H, I_r], filled from the checkpoint's per-expert tensors
(`mlp.experts.{e}.{gate,up,down}_proj.weight`). Under tensor parallelism each rank holds every
expert's slice I_r = I / N of the intermediate dimension (gate/up rows, down columns), so a
rank's output is a partial sum and one all-reduce completes the block, as for a dense MLP.
With expert parallelism (`TPGroup.expert_parallel`, --enable-expert-parallel) rank r holds
instead E_r = E / N whole experts, [r E_r, (r + 1) E_r): every rank routes every token (the
hidden states and the router are replicated), keeps the (token, expert) pairs of its experts
(`expert_map`, global -> local id, -1 elsewhere), runs them, and the same all-reduce sums the
ranks' partial outputs; no all-to-all (docs/architecture.md). The other ranks' pairs keep
their place as id -1 at weight 0, so the pair count and every shape stay those of TP
(capturable): experts_reference skips them, triton_moe.fused_experts (local_only) aligns them
into blocks its grouped GEMM skips, or, at 16 pairs or fewer, runs them through expert 0.

`experts_op(x, w13, w2, topk_weights, topk_ids)` computes the experts: `experts_reference` here
(per expert, its tokens gathered; data-dependent shapes, so eager only: the CPU and
enforce_eager), or on CUDA the fused Triton kernels of sluice.model.triton_moe (tokens sorted
by expert with static shapes, one grouped GEMM launch for gate/up and one for down with
SiLU-and-mul in its prologue; capturable in CUDA graphs), installed by sluice.worker.compile.

FP8 checkpoints (sluice.model.quantization): where the FP8 weights are kept (the loader's
`fp8_weights`), a layer whose experts are all FP8 in the checkpoint holds `w13` and `w2` in
float8_e4m3fn with float32 scales (`use_fp8`, `prepare_fp8_experts`): per row, [E, 2 I_r] and
[E, H], or per block, [E, 2 ceil(I_r / br), ceil(H / bc)] (gate's blocks, then up's) and
[E, ceil(H / br), ceil(I_r / bc)]. It then computes through `fp8_experts_op(x, w13, w2,
topk_weights, topk_ids, scales)`: `fp8_experts_reference` (the weights dequantized to x's dtype,
then experts_reference: the CPU, and the kernels' reference) or on CUDA triton_moe's W8A16
kernels (install_fp8_ops). Elsewhere the experts are dequantized at load.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.hf_config import MoeConfig
from sluice.model.linear import Linear
from sluice.model.quantization import Fp8CheckpointTensor, Fp8Config
from sluice.model.weights import LoadedWeight, check_shape


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] in the logits' dtype, expert ids [T, top_k]
    int64): the softmax over all experts in float32, its top k, renormalized to sum to 1 when
    `renormalize` (transformers' Qwen3MoeTopKRouter, in its order of operations)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum over a token's experts e of weight * down_e(silu(gate_e(x)) * up_e(x)): expert by
    expert over the tokens routed to it (as transformers computes it); an id -1 is skipped."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for expert in torch.unique(topk_ids).tolist():
        if expert < 0:  # another rank's pair (expert parallelism: FusedMoE.local_pairs)
            continue
        tokens, slots = torch.where(topk_ids == expert)
        h = F.linear(x[tokens], w13[expert])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[expert]) * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class ExpertScales(NamedTuple):
    """The float32 scales of a layer's FP8 `w13` and `w2` (the module's docstring: per row when
    `block` is None, else per `block` of (rows, columns), w13's gate and up parts each counted
    from their own first row)."""
    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int] | None


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                       halves: int, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 expert stack [E, N, K] (`halves` 2 for w13: gate rows then up rows, each with
    its own blocks; 1 for w2) times its scales, in float32, cast to `dtype`."""
    e, n, k = weight.shape
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block is None:
        return (w * s.reshape(e, n, 1)).to(dtype)
    br, bc = block
    rows = n // halves
    w = w.reshape(e, halves, rows, k)
    s = s.reshape(e, halves, -1, s.shape[-1])
    s = s.repeat_interleave(br, 2)[:, :, :rows].repeat_interleave(bc, 3)[..., :k]
    return (w * s).reshape(e, n, k).to(dtype)


def fp8_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          scales: ExpertScales) -> torch.Tensor:
    """experts_reference on FP8 experts, dequantized to x's dtype (as the load-time path
    does, so the same products): the CPU's op, and the reference of triton_moe's FP8 path."""
    return experts_reference(
        x, dequantize_experts(w13, scales.w13, scales.block, 2, x.dtype),
        dequantize_experts(w2, scales.w2, scales.block, 1, x.dtype), topk_weights, topk_ids)


class FusedMoE(nn.Module):
    """The sparse MLP block: router (`gate`, replicated), experts (`w13`, `w2`: this rank's slice
    of every expert's intermediate dimension, or under expert parallelism its whole experts
    [expert_start, expert_start + num_local_experts)). forward: x [T, H] -> [T, H], summed
    over ranks."""

    def __init__(self, hidden_size: int, moe: MoeConfig, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = moe.num_experts  # routed over: every expert of the layer
        self.top_k = moe.top_k
        self.renormalize = moe.norm_topk_prob
        self.full_intermediate = moe.intermediate_size
        # expert_map [E] int64: global expert id -> this rank's index, -1 for another rank's
        # (None without expert parallelism: every expert is local)
        if tp.expert_parallel and tp.size > 1:
            self.expert_start, self.num_local_experts = tp.shard(moe.num_experts, "num_experts")
            self.inter_start, self.inter_rows = 0, moe.intermediate_size
            expert_map = torch.full((moe.num_experts,), -1, dtype=torch.int64)
            expert_map[self.expert_start : self.expert_start + self.num_local_experts] = (
                torch.arange(self.num_local_experts))
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            self.expert_start, self.num_local_experts = 0, moe.num_experts
            self.inter_start, self.inter_rows = tp.shard(moe.intermediate_size,
                                                         "moe_intermediate_size")
            self.register_buffer("expert_map", None)
        self.gate = Linear(hidden_size, moe.num_experts)
        e, rows = self.num_local_experts, self.inter_rows
        self.w13 = nn.Parameter(torch.empty(e, 2 * rows, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, rows), requires_grad=False)
        self.experts_op = experts_reference
        self.route_op = route  # on CUDA triton_moe.fused_route (sluice.worker.compile)
        # FP8 experts (use_fp8): their scales; the op, on CUDA triton_moe.fused_experts
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        self.fp8_block: tuple[int, int] | None = None
        self.fp8_experts_op = fp8_experts_reference

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    def fp8_fits(self, block: tuple[int, int] | None) -> bool:
        """Whether the FP8 kernels (sluice.model.triton_moe) take scales per `block` (None: per
        row): a K step of the grouped GEMM (16 and up, a power of two) lies in one block
        column, so a block's columns must be a multiple of 16."""
        return block is None or block[1] % 16 == 0

    def use_fp8(self, block: tuple[int, int] | None) -> None:
        """Hold w13 and w2 as float8_e4m3fn with float32 scales per `block` (None: per row),
        for loading an FP8 checkpoint's experts as they are. Call before loading, after
        fp8_fits. ValueError naming the sizes where this rank's slice of the intermediate
        dimension does not start and end on the scale blocks (it would split a block's scale
        between ranks); never under expert parallelism, whose ranks hold whole experts."""
        e, two_rows, hidden = self.w13.shape
        rows, start, full = self.inter_rows, self.inter_start, self.full_intermediate
        if block is not None:
            end = start + rows
            for size, what in ((block[0], "intermediate rows of each expert's gate/up_proj"),
                               (block[1], "intermediate columns of each expert's down_proj")):
                if start % size or (end % size and end != full):
                    raise ValueError(
                        f"FP8 experts scaled per {block[0]}x{block[1]} block cannot be split "
                        f"over {self.tp.size} tensor-parallel ranks: each rank takes {rows} of "
                        f"the {full} {what}, and {rows} is not a "
                        f"multiple of the {size}-wide blocks (use a tensor_parallel_size that "
                        f"leaves each rank a multiple of {size}, or "
                        "SLUICE_FP8_WEIGHTS=dequantize)")
        device = self.w13.device
        fp8 = torch.float8_e4m3fn
        self.w13 = nn.Parameter(torch.empty(e, two_rows, hidden, dtype=fp8, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden, rows, dtype=fp8, device=device),
                               requires_grad=False)
        if block is None:
            w13_scale, w2_scale = (e, two_rows), (e, hidden)
        else:
            w13_scale = (e, 2 * -(-rows // block[0]), -(-hidden // block[1]))
            w2_scale = (e, -(-hidden // block[0]), -(-rows // block[1]))
        self.w13_scale = torch.empty(w13_scale, dtype=torch.float32, device=device)
        self.w2_scale = torch.empty(w2_scale, dtype=torch.float32, device=device)
        self.fp8_block = block

    def load_expert(self, expert: int, part: str, loaded_weight: LoadedWeight) -> None:
        """One checkpoint tensor of one expert (its global id): part "gate", "up" or "down".
        Another rank's expert (expert parallelism) is checked by shape and not read."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of a layer of {self.num_experts} experts")
        hidden, start, rows = self.w2.shape[1], self.inter_start, self.inter_rows
        if part not in ("gate", "up", "down"):
            raise ValueError(f"expert part must be 'gate', 'up' or 'down', got {part!r}")
        down = part == "down"
        shape = (hidden, self.full_intermediate) if down else (self.full_intermediate, hidden)
        check_shape(shape, loaded_weight, f"expert {part}_proj")
        expert -= self.expert_start
        if not 0 <= expert < self.num_local_experts:
            return
        if self.is_fp8:
            if not isinstance(loaded_weight, Fp8CheckpointTensor):
                raise ValueError("the layer holds FP8 experts but the checkpoint tensor is not "
                                 "FP8 (a quantization_config that names the wrong layers?)")
            weight = loaded_weight.narrow_fp8(int(down), start, rows)
            scale = loaded_weight.stored_scale(int(down), start, rows)
        else:
            weight = loaded_weight.narrow(int(down), start, rows)
        if down:
            self.w2.data[expert].copy_(weight)
            if self.is_fp8:
                self.w2_scale[expert].copy_(scale)
            return
        offset = 0 if part == "gate" else rows
        self.w13.data[expert, offset : offset + rows].copy_(weight)
        if self.is_fp8:
            first = offset if self.fp8_block is None else offset // rows * scale.shape[0]
            self.w13_scale[expert, first : first + scale.shape[0]].copy_(scale)

    def local_pairs(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: the routing (weights, global ids [T, top_k]) as this rank's
        experts see it: local ids, -1 and weight 0 for another rank's pair (the same shapes:
        the experts ops skip those, triton_moe.fused_experts with local_only)."""
        local = self.expert_map[topk_ids]
        return (torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights)),
                local.to(topk_ids.dtype))

    def rank_output(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (the same on every rank) -> this rank's share of the block's output [T, H]:
        every expert's slice (TP) or its whole experts (EP); the sum over ranks is the block."""
        weights, ids = self.route_op(self.gate(x), self.top_k, self.renormalize)
        if self.expert_map is not None:
            weights, ids = self.local_pairs(weights, ids)
        if self.is_fp8:
            return self.fp8_experts_op(x, self.w13, self.w2, weights, ids, ExpertScales(
                self.w13_scale, self.w2_scale, self.fp8_block))
        return self.experts_op(x, self.w13, self.w2, weights, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rank_output(x)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


def expert_tensor(name: str) -> tuple[str, int, str] | None:
    """'model.layers.3.mlp.experts.17.up_proj.weight' -> ('model.layers.3.mlp', 17, 'up'); None
    for other names."""
    head, sep, tail = name.partition(".experts.")
    if not sep:
        return None
    index, _, rest = tail.partition(".")
    part = rest.removesuffix("_proj.weight")
    if not index.isdigit() or part == rest:
        return None
    return head, int(index), part


def prepare_fp8_experts(model: nn.Module, quantization: Fp8Config, fp8_names: set[str]
                        ) -> tuple[int, int]:
    """Make each FusedMoE of `model` whose experts' weights are all FP8 in the checkpoint
    (`fp8_names`, as the model reads them: `model.sluice_weight_name`) hold FP8 experts
    (FusedMoE.use_fp8) where the kernels take its blocks (fp8_fits); the others (an ignored
    layer's, or blocks too narrow) load dequantized. Returns (layers made FP8, MoE layers)."""
    rename = getattr(model, "sluice_weight_name", None) or (lambda name: name)
    fp8 = {expert_tensor(rename(name)) for name in fp8_names}
    block = quantization.block_size if quantization.scheme == "block" else None
    kept = layers = 0
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        layers += 1
        if all((name, e, p) in fp8 for e in range(module.num_experts)
               for p in ("gate", "up", "down")) and module.fp8_fits(block):
            module.use_fp8(block)
            kept += 1
    return kept, layers


def load_experts(model: nn.Module, weights: Any) -> tuple[Any, set[str]]:
    """Split `weights` (HF name, tensor): expert tensors go into their FusedMoE now; the rest are
    yielded for load_packed_weights. Returns (that iterator, the names of the experts'
    parameters, which it must not expect); every expert's three tensors must arrive (checked
    when the iterator is exhausted)."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    seen: set[tuple[str, int, str]] = set()

    def rest():  # noqa: ANN202
        for name, tensor in weights:
            parsed = expert_tensor(name)
            if parsed is None:
                yield name, tensor
                continue
            module = modules.get(parsed[0])
            if module is None:
                raise ValueError(f"checkpoint tensor {name!r} has no destination: "
                                 f"{parsed[0]!r} is not a mixture-of-experts layer")
            try:
                module.load_expert(parsed[1], parsed[2], tensor)
            except ValueError as e:
                raise ValueError(f"cannot load checkpoint tensor {name!r}: {e}") from None
            seen.add(parsed)
        missing = [f"{m}.experts.{e}.{p}_proj.weight" for m, module in modules.items()
                   for e in range(module.num_experts) for p in ("gate", "up", "down")
                   if (m, e, p) not in seen]
        if missing:
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            raise ValueError(f"expert weights not in the checkpoint: {', '.join(missing[:4])}"
                             f"{more}")

    params = {f"{m}.{p}" for m in modules for p in ("w13", "w2")}
    return rest(), params
