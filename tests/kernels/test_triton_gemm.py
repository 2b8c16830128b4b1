"""The Triton GEMM of small decode batches (sluice.model.triton_gemm) computes F.linear: float32
within float32 rounding (no TF32), bfloat16 rounded once from the float32 sum (so within one
unit in the last place of torch's own bfloat16 product); with SiLU-and-mul folded in, what
F.linear(silu_and_mul(x)) computes. Split-K launches sum their partials and leave the arrival
counters at zero. Above MAX_ROWS rows the functions are F.linear itself.

On a CPU the kernel runs in Triton's interpreter (see conftest.py), so shapes stay tiny; on a
GPU the same tests run, plus Qwen3-0.6B's projection shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.model import triton_gemm
from sluice.model.layers import silu_and_mul
from sluice.model.triton_gemm import GemmConfig, choose_config, skinny_mm
from tests.kernels.test_fused_ops import bfloat16_casts_round_to_nearest  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=generator)).to(dtype).to(DEVICE)


def assert_product(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """actual == x @ weight^T: float32 to float32 rounding; 16-bit within one unit in the last
    place of the float32 sum rounded once, and exactly that value almost everywhere."""
    expected = x.double() @ weight.double().T
    assert actual.dtype == x.dtype and actual.shape == expected.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)
        return
    rounded = expected.to(x.dtype)
    torch.testing.assert_close(actual.float(), rounded.float(), rtol=2**-7, atol=2**-7)
    assert (actual != rounded).float().mean() < 0.02


CONFIGS = [
    GemmConfig(32, 16, 32, 4, 2, 1),
    GemmConfig(16, 16, 32, 4, 2, 2),  # split-K
    GemmConfig(32, 16, 16, 4, 3, 4),
    GemmConfig(8, 1, 64, 4, 1, 1, True),  # CUDA-core tiles, one row each (_row_mm_kernel)
    GemmConfig(4, 4, 32, 4, 3, 2, True),  # CUDA-core tiles of four rows, split-K
    GemmConfig(4, 1, 32, 2, 2, 2, True),  # one row a program, tiles loaded ahead, split-K
    GemmConfig(16, 1, 32, 4, 3, 1, True),  # one row a program, the loop pipelined by Triton
]


def config_id(c: GemmConfig) -> str:
    return (f"n{c.block_n}m{c.block_m}k{c.block_k}s{c.split_k}st{c.num_stages}"
            + ("fma" if c.fma else ""))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 32, 128), (5, 40, 128), (16, 48, 256), (19, 32, 128)])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_skinny_mm_is_the_product(dtype, m, n, k, config):
    """Rows past a tile (m = 5, 19) and weight rows past a tile (n = 40) are masked."""
    x = random(m, k, dtype=dtype, seed=1)
    weight = random(n, k, dtype=dtype, seed=2, scale=0.2)
    assert_product(skinny_mm(x, weight, config), x, weight)
    if config.split_k > 1:  # every tile's last split reset its counter
        assert int(triton_gemm._counters(x.device).abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS[:2] + CONFIGS[3:], ids=config_id)
def test_silu_mul_folded_into_the_product(dtype, config):
    m, n, k = 7, 32, 128
    gate_up = random(m, 2 * k, dtype=dtype, seed=3, scale=2.0)
    weight = random(n, k, dtype=dtype, seed=4, scale=0.2)
    got = skinny_mm(gate_up, weight, config, silu_mul=True)
    assert_product(got, silu_and_mul(gate_up), weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu_mul"])
def test_accumulate_adds_the_product_to_out(dtype, config, silu):
    """The folded layers' o_proj / down_proj: residual += x W^T in the epilogue (after the
    split-K sum), rounded once from the float32 sum of the product and the old value."""
    m, n, k = 5, 32, 128
    x = random(m, 2 * k if silu else k, dtype=dtype, seed=13, scale=2.0 if silu else 1.0)
    weight = random(n, k, dtype=dtype, seed=14, scale=0.2)
    residual = random(m, n, dtype=dtype, seed=15)
    before = residual.clone()
    returned = skinny_mm(x, weight, config, silu_mul=silu, out=residual, accumulate=True)
    assert returned.data_ptr() == residual.data_ptr()
    product = (silu_and_mul(x) if silu else x).double() @ weight.double().T
    expected = product + before.double()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(residual.double(), expected.to(dtype).double(),
                               rtol=tolerance, atol=tolerance)
    # without accumulate: overwritten (the TP ranks other than 0)
    skinny_mm(x, weight, config, silu_mul=silu, out=residual, accumulate=False)
    torch.testing.assert_close(residual.double(), product.to(dtype).double(),
                               rtol=tolerance, atol=tolerance)
    if config.split_k > 1:
        assert int(triton_gemm._counters(x.device).abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inv_rms_scales_each_row_as_rms_norm(dtype):
    """gate_up on the raw residual with the norm folded: (x W^T) / rms(x), i.e. rms_norm(x)
    (with unit weight) times W^T, each row's squares summed over the K loop's tiles."""
    m, n, k, eps = 6, 48, 128, 1e-6
    x = random(m, k, dtype=dtype, seed=16, scale=3.0)
    weight = random(n, k, dtype=dtype, seed=17, scale=0.2)
    got = triton_gemm.inv_rms_linear(x, weight, eps)
    x64 = x.double()
    expected = (x64 @ weight.double().T) / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.double(), expected.to(dtype).double(),
                               rtol=tolerance, atol=tolerance)
    assert triton_gemm.inv_rms_linear(random(triton_gemm.MAX_ROWS + 1, k, dtype=dtype, seed=18),
                                      weight, eps) is None  # the SiLU kernel's job then
    # one row a program (_row_mm_kernel), the squares summed elementwise over the K loop
    for row_config in (GemmConfig(8, 1, 32, 4, 2, 1, True), GemmConfig(16, 1, 64, 4, 3, 1, True)):
        torch.testing.assert_close(skinny_mm(x, weight, row_config, inv_rms_eps=eps).double(),
                                   expected.to(dtype).double(), rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="1 / rms needs whole plain rows"):
        skinny_mm(x, weight, CONFIGS[1], inv_rms_eps=eps)


def test_linear_add_falls_back_to_addmm_above_the_rows():
    weight = random(32, 64, dtype=torch.float32, seed=19)
    for rows in (3, triton_gemm.MAX_ROWS + 1):
        for silu in (False, True):
            x = random(rows, 128 if silu else 64, dtype=torch.float32, seed=20)
            residual = random(rows, 32, dtype=torch.float32, seed=21)
            expected = residual + F.linear(silu_and_mul(x) if silu else x, weight)
            triton_gemm.linear_add(residual, x, weight, accumulate=True, silu_mul=silu)
            torch.testing.assert_close(residual, expected, rtol=1e-5, atol=1e-5)
            triton_gemm.linear_add(residual, x, weight, accumulate=False, silu_mul=silu)
            torch.testing.assert_close(residual, F.linear(silu_and_mul(x) if silu else x,
                                                          weight), rtol=1e-5, atol=1e-5)


def test_a_strided_input_is_read_in_place():
    """The attention output is a view; rows of x may be spaced wider than K."""
    wide = random(6, 256, dtype=torch.float32, seed=5)
    x = wide[:, :128]
    weight = random(32, 128, dtype=torch.float32, seed=6)
    assert_product(skinny_mm(x, weight, CONFIGS[0]), x, weight)


def test_choose_config_for_qwen3_0_6b_decode():
    """The measured choices (H200: benchmarks/journal/2026-11-22-small-batch-gemm.md and
    2026-11-25-short-context-decode-graphs.md): one row in CUDA-core tiles of 4
    weight rows over 1024 of K; 16-row tiles up to 16 rows; q/k/v and o in 32-wide weight
    tiles, o with K split in four; gate_up in 64-wide tiles; down (SiLU-and-mul folded in)
    64-wide with K split in eight; cuBLAS above 16 rows."""
    assert choose_config(1, 4096, 1024) == GemmConfig(4, 1, 1024, 4, 2, 1, True)
    assert choose_config(1, 1024, 3072, silu_mul=True) == GemmConfig(2, 1, 1024, 4, 2, 1, True)
    assert choose_config(1, 1024, 2048) == GemmConfig(4, 1, 2048, 8, 2, 1, True)
    assert choose_config(16, 4096, 1024) == GemmConfig(32, 16, 128, 4, 5, 1)
    assert choose_config(16, 1024, 2048) == GemmConfig(32, 16, 128, 4, 5, 4)
    assert choose_config(8, 6144, 1024) == GemmConfig(64, 16, 128, 4, 5, 1)
    assert choose_config(2, 1024, 3072, silu_mul=True) == GemmConfig(64, 16, 128, 4, 5, 8)
    assert choose_config(17, 4096, 1024) is None
    assert choose_config(4, 4096, 1000) is None  # K with no factor of 16
    assert choose_config(4, 64, 96) == GemmConfig(32, 16, 32, 4, 5, 1)
    assert choose_config(1, 64, 96) == GemmConfig(4, 1, 32, 4, 2, 1, True)


def test_choose_config_for_qwen3_8b_decode():
    """One row: 2,048 of K an iteration over 8 warps wherever K has that factor (Qwen3-8B's
    K of 4,096 and 12,288), two weight rows a program under the SiLU prologue."""
    assert choose_config(1, 6144, 4096) == GemmConfig(4, 1, 2048, 8, 2, 1, True)
    assert choose_config(1, 24576, 4096) == GemmConfig(4, 1, 2048, 8, 2, 1, True)
    assert choose_config(1, 4096, 12288, silu_mul=True) == GemmConfig(2, 1, 2048, 8, 2, 1, True)


def test_linear_and_silu_mul_linear():
    """Small batches take the kernel, large ones are F.linear itself; leading dims kept."""
    weight = random(32, 64, dtype=torch.float32, seed=7)
    small = random(2, 3, 64, dtype=torch.float32, seed=8)
    got = triton_gemm.linear(small, weight)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got, F.linear(small, weight), rtol=1e-5, atol=1e-5)
    large = random(triton_gemm.MAX_ROWS + 1, 64, dtype=torch.float32, seed=9)
    assert torch.equal(triton_gemm.linear(large, weight), F.linear(large, weight))
    for rows in (3, triton_gemm.MAX_ROWS + 1):
        gate_up = random(rows, 128, dtype=torch.float32, seed=10)
        torch.testing.assert_close(triton_gemm.silu_mul_linear(gate_up, weight),
                                   F.linear(silu_and_mul(gate_up), weight),
                                   rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused_with_their_sizes():
    weight = random(32, 64, dtype=torch.float32, seed=11)
    with pytest.raises(ValueError, match=r"x of shape \(2, 48\) does not fit a weight of shape "
                                         r"\(32, 64\)"):
        skinny_mm(random(2, 48, dtype=torch.float32, seed=12), weight, CONFIGS[0])
    with pytest.raises(ValueError, match="with SiLU-and-mul"):
        skinny_mm(random(2, 64, dtype=torch.float32, seed=12), weight, CONFIGS[0],
                  silu_mul=True)
    with pytest.raises(ValueError, match="x is torch.bfloat16 but the weight is torch.float32"):
        skinny_mm(random(2, 64, dtype=torch.bfloat16, seed=12), weight, CONFIGS[0])
    with pytest.raises(ValueError, match="K=64 is not a multiple of split_k \\* block_k"):
        skinny_mm(random(2, 64, dtype=torch.float32, seed=12), weight,
                  GemmConfig(32, 16, 64, 4, 2, 2))
    with pytest.raises(ValueError, match="tensor-core tiles are at least 16 wide"):
        skinny_mm(random(2, 64, dtype=torch.float32, seed=12), weight,
                  GemmConfig(8, 16, 64, 4, 2, 1))


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes need a GPU")
@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("n,k,silu", [(4096, 1024, False), (1024, 2048, False),
                                      (6144, 1024, False), (1024, 3072, True)])
def test_qwen3_0_6b_projections_on_the_gpu(m, n, k, silu):
    x = random(m, 2 * k if silu else k, dtype=torch.bfloat16, seed=13)
    weight = random(n, k, dtype=torch.bfloat16, seed=14, scale=0.03)
    config = choose_config(m, n, k, silu_mul=silu)
    got = skinny_mm(x, weight, config, silu_mul=silu)
    assert_product(got, silu_and_mul(x) if silu else x, weight)
    assert int(triton_gemm._counters(x.device).abs().sum()) == 0
