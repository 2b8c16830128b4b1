"""Programmatic dependent launch (PDL) for the Triton kernels of the decoder's layers.

In the CUDA graph of a small decode batch each kernel is short (2 to 6 us at batch 1 for
Qwen3-0.6B on an H200) and the next one is only scheduled once it has ended: every kernel boundary
costs the launch of the next grid and the ramp-up of its first loads from memory. A kernel
launched with PDL (Hopper and later) may start while the kernel before it on the stream still
runs, once every program of that kernel has signalled `launch_dependents`; its programs then wait
(`griddepcontrol.wait`) until that kernel has finished and its writes are visible.

The rules every kernel here follows, which keep the order of every read and write what it is
without PDL:
- each program calls `pdl_wait` before it reads anything another kernel writes (activations,
  the KV cache, metadata) and before it writes anything, on every path, early exits included;
  only weights, which no kernel writes, are touched before it (`prefetch_l2`);
- `pdl_wait` signals `launch_dependents` only after its wait, so at most the next kernel's
  programs start early, and they start by waiting in turn.
So kernel N + 1 reads and writes only after kernel N has finished, and kernel N finished only
after its own wait returned, that is after kernel N - 1 had finished: every earlier kernel too. A
kernel launched without PDL (cuBLAS, torch's) waits for the full completion of the one before it,
as always.

`use_pdl(tensor, family)` says whether launches on that tensor's device use it: a CUDA device of
compute capability 9.0 or more, and not turned off with SLUICE_PDL (0: off; a comma-separated
list of FAMILIES: those only, for A/B runs). Never on the CPU (Triton's interpreter in the
tests), where the kernels take the branch without it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Bytes the memory system moves per L2 line.
L2_LINE_BYTES = 128


@functools.cache
def _device_supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


# The kernel families, each on or off with SLUICE_PDL: "0" none, "1" (the default) all, or a
# comma-separated list of families (for A/B runs).
FAMILIES = ("gemm", "attention", "ops")


def use_pdl(tensor: torch.Tensor, family: str) -> bool:
    """Whether a kernel of `family` (one of FAMILIES) launched on `tensor`'s device uses
    programmatic dependent launch."""
    if tensor.device.type != "cuda":
        return False
    setting = os.environ.get("SLUICE_PDL", "1")
    if setting == "0" or (setting != "1" and family not in setting.split(",")):
        return False
    return _device_supports_pdl(tensor.device.index or 0)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the kernel before to finish (its writes visible), then let the next kernel's
    programs start. A no-op without PDL."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the L2 lines at `ptrs` (a tensor of addresses) without waiting for them: a
    program's weights, on their way while the kernel before still runs."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


def line_elems(tensor: torch.Tensor) -> int:
    """Elements of `tensor`'s dtype per L2 line."""
    return max(1, L2_LINE_BYTES // tensor.element_size())


def lines_pad(num_elems: int, tensor: torch.Tensor) -> int:
    """A power of two at least the L2 lines that `num_elems` contiguous elements span."""
    return triton.next_power_of_2(triton.cdiv(num_elems, line_elems(tensor)))
