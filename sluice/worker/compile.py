"""torch.compile for the small elementwise ops (RMSNorm with residual add, rotary embedding,
SiLU-and-mul): each becomes one fused kernel instead of several, which matters most in decode,
where the model is a chain of small launches.

One compiled function per op is shared by every layer of the model (dynamo caches by code, so
compiling each module's forward instead would recompile per layer and soon fall back to eager).
Only the instance attributes of this model change; other engines in the process are untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.model.layers import (
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    add_rms_norm,
    apply_rotary,
    rms_norm,
    silu_and_mul,
)


def compile_small_ops(model: nn.Module) -> None:
    compiled_norm = torch.compile(rms_norm, dynamic=True, fullgraph=True)
    compiled_add_norm = torch.compile(add_rms_norm, dynamic=True, fullgraph=True)
    compiled_rotary = torch.compile(apply_rotary, dynamic=True, fullgraph=True)
    compiled_silu = torch.compile(silu_and_mul, dynamic=True, fullgraph=True)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.norm_op = compiled_norm
            module.add_norm_op = compiled_add_norm
        elif isinstance(module, RotaryEmbedding):
            module.rotary_op = compiled_rotary
        elif isinstance(module, SiluAndMul):
            module.op = compiled_silu
