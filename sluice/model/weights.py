"""Parameters and what fills them: each parameter carries `weight_loader(param, loaded_weight,
shard_id)`, which takes its part of a checkpoint tensor.

`loaded_weight` is a torch.Tensor or a `CheckpointTensor`, a safetensors tensor not read yet: a
tensor-parallel layer reads only its rank's rows or columns of it (`narrow`), so a rank reads
1 / N of a sharded weight from disk, and replicated parameters read it whole (`read_full`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class CheckpointTensor:
    """One tensor of an open safetensors file (safe_open), read on demand and cast: floating
    point to `dtype`, other dtypes kept. Valid while its file is open (during the iteration of
    sluice.model.loader.iterate_weights)."""

    def __init__(self, handle: Any, name: str, dtype: torch.dtype) -> None:
        self._handle = handle
        self._name = name
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self._dtype = dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length), read from the file alone."""
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._cast(self._slice[index])

    def read(self) -> torch.Tensor:
        if not self.shape:  # a scalar has nothing to slice
            return self._cast(self._handle.get_tensor(self._name))
        return self._cast(self._slice[:])

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._dtype) if tensor.is_floating_point() else tensor


class RowSlice:
    """Rows [start, start + rows) of a checkpoint tensor (a torch.Tensor or CheckpointTensor),
    read on demand: one part of a fused weight (Phi-3's qkv_proj) loaded as its own shard."""

    def __init__(self, tensor: Any, start: int, rows: int) -> None:
        self._tensor = tensor
        self._start = start
        self.shape = (rows, *tuple(tensor.shape)[1:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._tensor.narrow(0, self._start + start, length)
        return self.read().narrow(dim, start, length)

    def read(self) -> torch.Tensor:
        return self._tensor.narrow(0, self._start, self.shape[0])


LoadedWeight = torch.Tensor | CheckpointTensor | RowSlice


def read_full(loaded_weight: LoadedWeight) -> torch.Tensor:
    return loaded_weight if isinstance(loaded_weight, torch.Tensor) else loaded_weight.read()


def check_shape(expected: tuple[int, ...] | torch.Size, loaded_weight: LoadedWeight,
                what: str) -> None:
    if tuple(expected) != tuple(loaded_weight.shape):
        raise ValueError(
            f"shape mismatch for {what}: parameter expects {list(expected)}, "
            f"checkpoint has {list(loaded_weight.shape)}"
        )


def default_weight_loader(
    param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
) -> None:
    """A replicated parameter: the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"parameter is not merged, got shard id {shard_id!r}")
    check_shape(param.shape, loaded_weight, "parameter")
    param.data.copy_(read_full(loaded_weight))


def new_param(*shape: int) -> nn.Parameter:
    """An uninitialised parameter (the current default device and dtype) that the loader fills;
    replicated unless its layer sets another `weight_loader`."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param
