"""The decoder's linear layers, Megatron style, each parameter loading its own share of the full
Hugging Face tensor (sluice.model.weights), so the model files stay a plain description of the
network and read the same at any tensor-parallel size.

- `MergedColumnParallelLinear` (gate/up) and `QKVParallelLinear` (q/k/v): output features split
  over the ranks. Rank r holds its rows of each stacked checkpoint tensor and computes its
  columns of y; no communication. Attention heads and the MLP's intermediate features are
  independent, so a rank goes on with its own heads (its slice of the intermediate) alone.
- `RowParallelLinear` (o_proj, down_proj): input features split, so each rank's x W_r^T is a
  partial sum of y, and one all-reduce makes y on every rank. The bias is added once (rank 0).
- `Linear`: the same on every rank (EAGLE's fc).

At TP = 1 (SINGLE_RANK) every layer runs exactly the ops it always ran: no collective, no copy.

FP8 checkpoints (sluice.model.quantization): a layer may keep its FP8 weight and float32 scales
(`Linear.use_fp8`, before loading), each rank loading its rows or columns of both; it then
multiplies through `fp8_op` (sluice.model.fp8_gemm on CUDA, the dequantizing reference
elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.distributed.head_split import check_head_split, first_kv_head, kv_heads_per_rank
from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.quantization import Fp8CheckpointTensor, fp8_linear_reference
from sluice.model.weights import LoadedWeight, check_shape, default_weight_loader, new_param


class Linear(nn.Module):
    """y = x W^T (+ b); W: [output_size, input_size]. Replicated on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = new_param(output_size, input_size)
        self.bias = new_param(output_size) if bias else None
        # (x, weight) -> x W^T; the Triton GEMM of small batches on CUDA (install_fused_ops)
        self.gemm_op = None
        # (x, weight, eps) -> (x W^T) / rms(x) per row, or None at sizes it does not run
        # (the folded layers' gate_up_proj on CUDA: install_fused_ops)
        self.inv_rms_gemm_op = None
        # FP8 weights (use_fp8): the scales' block (rows, columns), None for one per row
        self.register_buffer("weight_scale", None)
        self.fp8_block: tuple[int, int] | None = None
        # (x, weight, scale, block) -> x W^T for FP8 weights (sluice.model.fp8_gemm on CUDA)
        self.fp8_op = fp8_linear_reference

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale is not None

    def fp8_fits(self, block: tuple[int, int] | None) -> bool:
        """Whether this rank's weight can be loaded as FP8 with scales per `block` (None: per
        row): the FP8 kernels take blocks a multiple of 32 wide along K; the parallel layers
        also need every piece this rank takes of a checkpoint tensor to start and end on a
        block."""
        return block is None or block[1] % 32 == 0  # the FP8 tensor cores' K step (W8A8)

    def use_fp8(self, block: tuple[int, int] | None) -> None:
        """Hold the weight as float8_e4m3fn with float32 scales per `block` of (rows, columns)
        ([ceil(N / rows), ceil(K / columns)]), or per row ([N]) when None, for loading an FP8
        checkpoint (the loader then fills both). Call before loading, after fp8_fits."""
        n, k = self.weight.shape
        device = self.weight.device
        loader = self.weight.weight_loader
        if loader is default_weight_loader:
            loader = self.weight_loader_full
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = loader
        shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
        self.weight_scale = torch.empty(shape, dtype=torch.float32, device=device)
        self.fp8_block = block

    def fp8_pieces(self, param: nn.Parameter, loaded_weight: LoadedWeight, dim: int, start: int,
                   length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(FP8 rows or columns, their scales) of `loaded_weight` for this FP8 layer's weight,
        or None where the layer is not FP8 (the dequantized piece is read then)."""
        if param is not self.weight or not self.is_fp8:
            return None
        if not isinstance(loaded_weight, Fp8CheckpointTensor):
            raise ValueError("the layer holds FP8 weights but the checkpoint tensor is not FP8 "
                             "(a quantization_config that names the wrong layers?)")
        return (loaded_weight.narrow_fp8(dim, start, length),
                loaded_weight.stored_scale(dim, start, length))

    def weight_loader_full(self, param: nn.Parameter, loaded_weight: LoadedWeight,
                           shard_id: Any = None) -> None:
        """A replicated FP8 layer's weight (a plain Linear after use_fp8)."""
        if shard_id is not None:
            raise ValueError(f"parameter is not merged, got shard id {shard_id!r}")
        check_shape(param.shape, loaded_weight, "parameter")
        pieces = self.fp8_pieces(param, loaded_weight, 0, 0, param.shape[0])
        if pieces is None:
            param.data.copy_(loaded_weight if isinstance(loaded_weight, torch.Tensor)
                             else loaded_weight.read())
            return
        param.data.copy_(pieces[0])
        self.weight_scale.copy_(pieces[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            y = self.fp8_op(x, self.weight, self.weight_scale, self.fp8_block)
            return y if self.bias is None else y + self.bias
        if self.gemm_op is not None and self.bias is None:
            return self.gemm_op(x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def inv_rms_forward(self, x: torch.Tensor, eps: float) -> torch.Tensor | None:
        """forward(x) / rms(x) per row in one op (a norm folded into this weight,
        LlamaModel.fold_norms), or None where no such op runs at x's size."""
        if self.inv_rms_gemm_op is None or self.bias is not None:
            return None
        return self.inv_rms_gemm_op(x, self.weight, eps)


@dataclass(frozen=True)
class OutputShard:
    """One checkpoint tensor stacked into a column-parallel parameter: it has `full_rows`
    rows, of which this rank holds [start, start + rows)."""

    full_rows: int
    start: int
    rows: int


class MergedColumnParallelLinear(Linear):
    """Several linear maps of one input stacked along the output (gate_up_proj), each split
    over the ranks on its own: shard i (an int) fills this rank's rows
    [sum(rows of shards < i), + its rows) from its rows of checkpoint tensor i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup = SINGLE_RANK, shards: list[OutputShard] | None = None) -> None:
        if shards is None:
            shards = [OutputShard(size, *tp.shard(size, f"output size of shard {i}"))
                      for i, size in enumerate(output_sizes)]
        super().__init__(input_size, sum(s.rows for s in shards), bias)
        self.tp = tp
        self.shards = shards
        self.output_sizes = [s.rows for s in shards]  # this rank's, in shard order
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def shard_index(self, shard_id: Any) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.shards):
            raise ValueError(
                f"shard id must be an int in [0, {len(self.shards)}), got {shard_id!r}")
        return shard_id

    def fp8_fits(self, block: tuple[int, int] | None) -> bool:
        if not super().fp8_fits(block):
            return False
        if block is None:
            return True
        offset = 0
        for shard in self.shards:  # each shard's rows start on a block of its own tensor and
            # of the stacked weight, and end on one (or at the tensor's end)
            end = shard.start + shard.rows
            if (shard.start % block[0] or offset % block[0]
                    or (end % block[0] and end != shard.full_rows)):
                return False
            offset += shard.rows
        return True

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight,
                      shard_id: Any) -> None:
        index = self.shard_index(shard_id)
        shard = self.shards[index]
        check_shape((shard.full_rows, *param.shape[1:]), loaded_weight, f"shard {shard_id!r}")
        offset = sum(s.rows for s in self.shards[:index])
        pieces = self.fp8_pieces(param, loaded_weight, 0, shard.start, shard.rows)
        if pieces is None:
            param.data.narrow(0, offset, shard.rows).copy_(
                loaded_weight.narrow(0, shard.start, shard.rows))
            return
        weight, scale = pieces
        param.data.narrow(0, offset, shard.rows).copy_(weight)
        first = offset if self.fp8_block is None else offset // self.fp8_block[0]
        self.weight_scale.narrow(0, first, scale.shape[0]).copy_(scale)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul, over this rank's heads: H / N query heads, and
    max(1, KVH / N) key/value heads, replicated when KVH < N (rank r holds the KV head its
    query heads read: query head h reads KV head h // (H / KVH)). Weight [(Hr + 2 * KVHr) * D,
    hidden]; shard ids "q", "k", "v". Output [T, (Hr + 2 * KVHr) * D]: split it at `q_size`
    and `q_size + kv_size`."""

    _SHARD_INDEX = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, tp: TPGroup = SINGLE_RANK) -> None:
        check_head_split(tp.size, num_heads, num_kv_heads)
        self.num_heads = num_heads // tp.size  # this rank's
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        q = OutputShard(num_heads * head_dim, tp.rank * self.num_heads * head_dim,
                        self.num_heads * head_dim)
        kv = OutputShard(num_kv_heads * head_dim,
                         first_kv_head(num_kv_heads, tp.size, tp.rank) * head_dim,
                         self.num_kv_heads * head_dim)
        super().__init__(hidden_size, [], bias, tp, shards=[q, kv, kv])
        self.q_size = q.rows
        self.kv_size = kv.rows

    def shard_index(self, shard_id: Any) -> int:
        if shard_id not in self._SHARD_INDEX:
            raise ValueError(f"shard id must be one of ['q', 'k', 'v'], got {shard_id!r}")
        return self._SHARD_INDEX[shard_id]


class RowParallelLinear(Linear):
    """Input features split over the ranks: rank r holds columns [r * K / N, (r + 1) * K / N)
    of W and reads its slice of x (a column-parallel layer's output); y = sum over ranks of
    x_r W_r^T, one all-reduce. The bias (replicated) is added on rank 0 only."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPGroup = SINGLE_RANK) -> None:
        start, size = tp.shard(input_size, "input size")
        super().__init__(size, output_size, bias)
        self.tp = tp
        self.full_input_size = input_size
        self.input_start = start
        self.weight.weight_loader = self.weight_loader
        # (out, x, weight, accumulate, silu_mul) -> None: out (+)= x W^T in place, for add_to
        # (the Triton GEMM's epilogue at small batches on CUDA: install_fused_ops)
        self.add_gemm_op = None

    def fp8_fits(self, block: tuple[int, int] | None) -> bool:
        if not super().fp8_fits(block):
            return False
        end = self.input_start + self.input_size
        return block is None or not (self.input_start % block[1]
                                     or (end % block[1] and end != self.full_input_size))

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight,
                      shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter is not merged, got shard id {shard_id!r}")
        check_shape((self.output_size, self.full_input_size), loaded_weight, "parameter")
        pieces = self.fp8_pieces(param, loaded_weight, 1, self.input_start, self.input_size)
        if pieces is None:
            param.data.copy_(loaded_weight.narrow(1, self.input_start, self.input_size))
            return
        param.data.copy_(pieces[0])
        self.weight_scale.copy_(pieces[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K / N] (this rank's features) -> y [T, output_size], summed over ranks."""
        if self.is_fp8:
            y = self.fp8_op(x, self.weight, self.weight_scale, self.fp8_block)
            if self.bias is not None and self.tp.rank == 0:
                y = y + self.bias
            return self.all_reduce(y)
        if self.gemm_op is not None and self.bias is None:
            return self.all_reduce(self.gemm_op(x, self.weight))
        bias = self.bias if self.tp.rank == 0 else None
        return self.all_reduce(F.linear(x, self.weight, bias))

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's x_r W_r^T (from forward, or an op that fused the GEMM, e.g. the down
        projection with SiLU-and-mul) -> the sum over ranks, in place. At TP = 1: as is."""
        if self.tp.size == 1:
            return partial
        return self.tp.all_reduce(partial)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor, silu_mul: bool = False) -> None:
        """residual += x W^T summed over ranks, in place, the add inside the GEMM (cuBLAS's
        beta, or the Triton GEMM's epilogue), for the layers' folded path
        (LlamaModel.fold_norms); no bias. `silu_mul`: x is SwiGLU's (gate, up) and the
        product is of silu_and_mul(x) (in the Triton GEMM's prologue where it runs).

        At TP > 1 the partial sums cannot each be added to the residual (it would count the
        residual N times) and reducing the output before the add would cost an add launch:
        rank 0 accumulates its partial into the residual (beta 1), the other ranks overwrite
        theirs with their partial (beta 0; their residual is the same as rank 0's, and is
        rebuilt), and one all-reduce of the residual sums them: still one GEMM and one
        all-reduce a projection, no add."""
        assert self.bias is None, "the folded path never runs a projection with a bias"
        accumulate = self.tp.rank == 0
        if self.add_gemm_op is not None:
            self.add_gemm_op(residual, x, self.weight, accumulate, silu_mul)
        else:
            if silu_mul:
                from sluice.model.layers import silu_and_mul

                x = silu_and_mul(x)
            residual.addmm_(x, self.weight.t(), beta=1 if accumulate else 0)
        if self.tp.size > 1:
            self.tp.all_reduce(residual)
