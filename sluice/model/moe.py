"""A mixture-of-experts MLP (Qwen3-MoE's sparse block): a router picks `top_k` of `num_experts`
SwiGLU experts per token and the block returns their outputs weighted by the router's softmax.

Each layer's experts are two stacked parameters, `w13` [E, 2 I_r, H] (each expert's gate rows then
up rows) and `w2` [E, H, I_r], filled from the checkpoint's per-expert tensors
(`mlp.experts.{e}.{gate,up,down}_proj.weight`). Under tensor parallelism each rank holds every
expert's slice I_r = I / N of the intermediate dimension (gate/up rows, down columns), so a
rank's output is a partial sum and one all-reduce completes the block, as for a dense MLP;
expert parallelism (ranks holding whole experts) is not built: docs/architecture.md.

`experts_op(x, w13, w2, topk_weights, topk_ids)` computes the experts: `experts_reference` here
(per expert, its tokens gathered; data-dependent shapes, so eager only: the CPU and
enforce_eager), or on CUDA the fused Triton kernels of sluice.model.triton_moe (tokens sorted
by expert with static shapes, one grouped GEMM launch for gate/up and one for down with
SiLU-and-mul in its prologue; capturable in CUDA graphs), installed by sluice.worker.compile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.hf_config import MoeConfig
from sluice.model.linear import Linear
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
    expert over the tokens routed to it (as transformers computes it)."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.where(topk_ids == expert)
        h = F.linear(x[tokens], w13[expert])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[expert]) * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class FusedMoE(nn.Module):
    """The sparse MLP block: router (`gate`, replicated), experts (`w13`, `w2`: this rank's slice
    of every expert's intermediate dimension). forward: x [T, H] -> [T, H], summed over ranks."""

    def __init__(self, hidden_size: int, moe: MoeConfig, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.renormalize = moe.norm_topk_prob
        self.full_intermediate = moe.intermediate_size
        self.inter_start, self.inter_rows = tp.shard(moe.intermediate_size,
                                                     "moe_intermediate_size")
        self.gate = Linear(hidden_size, moe.num_experts)
        e, rows = moe.num_experts, self.inter_rows
        self.w13 = nn.Parameter(torch.empty(e, 2 * rows, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, rows), requires_grad=False)
        self.experts_op = experts_reference
        self.route_op = route  # on CUDA triton_moe.fused_route (sluice.worker.compile)

    def load_expert(self, expert: int, part: str, loaded_weight: LoadedWeight) -> None:
        """One checkpoint tensor of one expert: part "gate", "up" or "down"."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of a layer of {self.num_experts} experts")
        hidden, start, rows = self.w2.shape[1], self.inter_start, self.inter_rows
        if part in ("gate", "up"):
            check_shape((self.full_intermediate, hidden), loaded_weight, f"expert {part}_proj")
            offset = 0 if part == "gate" else rows
            self.w13.data[expert, offset : offset + rows].copy_(
                loaded_weight.narrow(0, start, rows))
        elif part == "down":
            check_shape((hidden, self.full_intermediate), loaded_weight, "expert down_proj")
            self.w2.data[expert].copy_(loaded_weight.narrow(1, start, rows))
        else:
            raise ValueError(f"expert part must be 'gate', 'up' or 'down', got {part!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route_op(self.gate(x), self.top_k, self.renormalize)
        out = self.experts_op(x, self.w13, self.w2, weights, ids)
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
