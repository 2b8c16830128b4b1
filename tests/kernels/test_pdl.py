"""Programmatic dependent launch (sluice.model.pdl): on where it should be and off elsewhere, and
on a Hopper GPU, a chain of dependent kernels launched with it, replayed in a CUDA graph, gives
bit for bit what the same chain gives launched without it (a kernel that read or wrote before
the one before it had finished would race and, over many replays, differ)."""

from __future__ import annotations

import pytest
import torch

from sluice.model import pdl
from sluice.model.triton_gemm import choose_config, skinny_mm
from sluice.model.triton_ops import qk_norm_rope, rms_norm

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_off_on_the_cpu_and_when_turned_off(monkeypatch):
    monkeypatch.delenv("SLUICE_PDL", raising=False)
    assert not pdl.use_pdl(torch.zeros(1), "gemm")
    if HOPPER:
        gpu = torch.zeros(1, device="cuda")
        assert all(pdl.use_pdl(gpu, family) for family in pdl.FAMILIES)
        monkeypatch.setenv("SLUICE_PDL", "0")
        assert not any(pdl.use_pdl(gpu, family) for family in pdl.FAMILIES)
        monkeypatch.setenv("SLUICE_PDL", "gemm,ops")
        assert [pdl.use_pdl(gpu, f) for f in ("gemm", "attention", "ops")] == [True, False, True]


def test_l2_lines():
    assert pdl.line_elems(torch.zeros(1, dtype=torch.bfloat16)) == 64
    assert pdl.line_elems(torch.zeros(1, dtype=torch.float32)) == 32
    assert pdl.lines_pad(384, torch.zeros(1, dtype=torch.bfloat16)) == 8  # 6 lines
    assert pdl.lines_pad(1024, torch.zeros(1, dtype=torch.bfloat16)) == 16


def _layers(seed: int) -> list[torch.Tensor]:
    """Four Qwen3-0.6B-shaped projections and q/k norm weights."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 0.03) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g)).to(torch.bfloat16).cuda()

    return [w(4096, 1024), w(1024, 2048), w(6144, 1024), w(1024, 3072),
            w(128, scale=1.0).abs() + 0.5, w(128, scale=1.0).abs() + 0.5]


def _decoder_chain(residual: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   layers: list[list[torch.Tensor]]) -> torch.Tensor:
    """The batch-1 layer's kernels, each reading what the one before wrote: qkv with the norm
    folded (1 / rms), q/k norm and rope in place, o_proj added into the residual, gate_up with
    1 / rms, down with SiLU-and-mul added into the residual; then a final norm."""
    m = residual.shape[0]
    for qkv_w, o_w, gate_up_w, down_w, q_norm, k_norm in layers:
        qkv = skinny_mm(residual, qkv_w, choose_config(m, 4096, 1024, split_k=False),
                        inv_rms_eps=1e-6)
        q, _ = qk_norm_rope(qkv, positions, cos_sin, q_norm, k_norm, 1e-6, 16, 8)
        skinny_mm(q, o_w, choose_config(m, 1024, 2048), out=residual, accumulate=True)
        gate_up = skinny_mm(residual, gate_up_w, choose_config(m, 6144, 1024, split_k=False),
                            inv_rms_eps=1e-6)
        skinny_mm(gate_up, down_w, choose_config(m, 1024, 3072, silu_mul=True), silu_mul=True,
                  out=residual, accumulate=True)
    return rms_norm(residual, layers[0][4].new_ones(1024), 1e-6)


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a Hopper GPU")
@pytest.mark.parametrize("m", [1, 16])
def test_chain_in_a_cuda_graph_matches_launches_without_pdl(monkeypatch, m):
    layers = [_layers(seed) for seed in range(6)]
    g = torch.Generator().manual_seed(99)
    start = torch.randn(m, 1024, generator=g).to(torch.bfloat16).cuda()
    positions = torch.arange(7, 7 + m, device="cuda")
    freqs = torch.outer(torch.arange(64, dtype=torch.float32),
                        1.0 / 10000 ** (torch.arange(0, 128, 2).float() / 128))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).cuda()

    monkeypatch.setenv("SLUICE_PDL", "0")
    expected = _decoder_chain(start.clone(), positions, cos_sin, layers)

    monkeypatch.setenv("SLUICE_PDL", "1")
    residual = start.clone()
    _decoder_chain(residual.clone(), positions, cos_sin, layers)  # compile, warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decoder_chain(residual, positions, cos_sin, layers)
    for _ in range(20):
        residual.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
