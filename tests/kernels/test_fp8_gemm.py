"""The FP8 matmuls (sluice.model.fp8_gemm) against their torch references:

- weight-only (one-row decode steps; and the tensor-core tiles of many rows): the product of
  x with the dequantized weight (quantization.fp8_linear_reference), within float32
  summation order in float32 and within bfloat16 rounding of the sum in bfloat16;
- activation quantization: exactly quantize_activations_reference (the same scales, the same
  FP8 values);
- W8A8: the float32 product of the dequantized activations and weights, rounded to the output
  dtype (summation order apart);
- fp8_linear: weight-only up to WEIGHT_ONLY_MAX_ROWS rows, W8A8 above, and close to the
  reference (the activations' rounding is the difference: stated below).

On a CPU the kernels run in Triton's interpreter (conftest.py), so shapes stay tiny; on a GPU
the same tests run, plus Qwen3-8B's projection shapes, and torch._scaled_mm's path for
per-row scales.
"""

from __future__ import annotations

import pytest
import torch

from sluice.model import fp8_gemm
from sluice.model.fp8_gemm import (
    Fp8GemmConfig,
    quantize_activations,
    quantize_activations_reference,
    w8a8_mm,
    w8a16_mm,
)
from sluice.model.quantization import dequantize_stored, fp8_linear_reference, quantize_fp8
from tests.kernels.test_fused_ops import bfloat16_casts_round_to_nearest  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fp8_weight(n: int, k: int, block: tuple[int, int] | None, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight quantized per block, or per row ([N] scales) when block is None."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=generator) * 0.05
    # rows of very different magnitudes, so per-row and per-block scales matter
    dense *= torch.logspace(-2, 1, n)[torch.randperm(n, generator=generator)][:, None]
    if block is None:
        weight, scale = quantize_fp8(dense, "channel")
        scale = scale.reshape(n)
    else:
        weight, scale = quantize_fp8(dense, "block", block)
    return weight.to(DEVICE), scale.to(DEVICE)


def activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    x[:, ::7] *= 20  # outlier channels, as in real activations
    return x.to(dtype).to(DEVICE)


def exact_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  block: tuple[int, int] | None) -> torch.Tensor:
    return x.double() @ dequantize_stored(weight, scale, block, torch.float64).T


BLOCKS = [(16, 32), (32, 32), None]  # the FP8 tensor cores take 32 of K at a time


@pytest.mark.parametrize("tiles", ["one_row", "tensor_cores"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_the_weight_only_product_is_x_times_the_dequantized_weight(
        m: int, block: tuple[int, int] | None, dtype: torch.dtype, tiles: str) -> None:
    n, k = 96, 80  # K not a multiple of the one-row kernel's K step
    weight, scale = fp8_weight(n, k, block, seed=m)
    x = activations(m, k, dtype, seed=10 + m)
    config = None if tiles == "one_row" else Fp8GemmConfig(16, 16, 32, 4, 2)
    actual = w8a16_mm(x, weight, scale, block, config)
    # The tensor-core tiles dequantize a block-scaled tile to x's dtype before the product, as
    # the reference does (fp8 * scale, rounded once); the one-row kernel scales x's slice.
    rounded = dtype if (config is not None and block is not None) else torch.float64
    expected = x.double() @ dequantize_stored(weight, scale, block, rounded).double().T
    assert actual.dtype == dtype and actual.shape == (m, n)
    if dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-2)
    reference = fp8_linear_reference(x, weight, scale, block)
    scale_of_y = expected.abs().max().item()
    assert (actual.double() - reference.double()).abs().max().item() < 0.02 * scale_of_y


def test_a_one_row_program_s_rows_share_a_block_row() -> None:
    """Block rows of 8: the one-row kernel takes 4 weight rows a program, never 4 across two
    block rows; and tiles that do not fit the blocks are refused, naming them."""
    weight, scale = fp8_weight(40, 64, (8, 16), seed=3)
    x = activations(1, 64, torch.float32, seed=4)
    torch.testing.assert_close(w8a16_mm(x, weight, scale, (8, 16)).double(),
                               exact_product(x, weight, scale, (8, 16)), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="does not fit 8x16 scale blocks"):
        w8a16_mm(activations(2, 64, torch.float32, 5), weight, scale, (8, 16),
                 Fp8GemmConfig(16, 16, 16, 4, 1))


@pytest.mark.parametrize("group", [None, 16, 32])
def test_activation_quantization_equals_the_reference(group: int | None) -> None:
    x = activations(5, 80, torch.bfloat16, seed=1)
    x[2] = 0  # an all-zero row: zeros, not NaN
    q, scales = quantize_activations(x, group)
    q_ref, scales_ref = quantize_activations_reference(x, group)
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.shape == ((5,) if group is None else (5, -(-80 // group)))
    torch.testing.assert_close(scales, scales_ref, rtol=0, atol=0)
    assert torch.equal(q.float(), q_ref.float())
    assert torch.isfinite(q.float()).all() and (q[2].float() == 0).all()
    # x ~= q * scale: FP8's 3 mantissa bits, relative to each group's largest value
    size = 80 if group is None else group
    per_element = (scales if group is None else scales.repeat_interleave(size, 1)[:, :80])
    restored = q.float() * per_element.reshape(5, -1)
    assert ((restored - x.float()).abs() <= per_element.reshape(5, -1) * 448 / 16 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("m", [17, 70])
def test_the_w8a8_product_is_the_dequantized_fp8_operands_product(
        m: int, block: tuple[int, int] | None, dtype: torch.dtype) -> None:
    n, k = 96, 80
    weight, scale = fp8_weight(n, k, block, seed=m)
    x = activations(m, k, dtype, seed=20 + m)
    q, q_scale = quantize_activations_reference(x, block[1] if block else None)
    q_scale = q_scale.reshape(m, -1) if block else q_scale.reshape(m, 1)
    per_element = q_scale.repeat_interleave(block[1], 1)[:, :k] if block else q_scale
    x_restored = q.double() * per_element.double()
    expected = x_restored @ dequantize_stored(weight, scale, block, torch.float64).T
    configs = [None, Fp8GemmConfig(16, 32, 32, 4, 2, group_m=2)]
    for config in configs:
        actual = w8a8_mm(x, weight, scale, block, config, backend="triton")
        assert actual.dtype == dtype and actual.shape == (m, n)
        if DEVICE == "cuda":
            # Hopper's FP8 tensor cores keep fewer bits than float32 while they sum within
            # a chain of MMAs (about 14: DeepSeek-V3's report, section 3.3.2): the per-channel
            # kernel chains them over all of K, the block kernel over a block's K
            error = (actual.double() - expected).norm() / expected.norm()
            assert error < 2**-8, error
            continue
        torch.testing.assert_close(actual.double(), expected.to(dtype).double(),
                                   rtol=2**-7 if dtype != torch.float32 else 1e-5, atol=1e-3)


@pytest.mark.skipif(DEVICE != "cuda", reason="torch._scaled_mm's scaled products run on CUDA")
@pytest.mark.parametrize("m", [17, 100, 3001])
@pytest.mark.parametrize("block", [(128, 128), None])
def test_scaled_mm_equals_the_triton_w8a8_kernel(m: int, block: tuple[int, int] | None) -> None:
    """cuBLAS through torch._scaled_mm: row-wise scales, and 128 x 128 blocks where this torch
    takes them (block_scaled_mm_supported): the Triton kernel's product, rounding apart."""
    if block is not None and not fp8_gemm.block_scaled_mm_supported(torch.device(DEVICE)):
        pytest.skip("this torch's _scaled_mm takes no block scales")
    weight, scale = fp8_weight(512, 512, block, seed=1)  # 4 blocks along K (block_scaled_mm_fits)
    x = activations(m, 512, torch.bfloat16, seed=2)
    cublas = w8a8_mm(x, weight, scale, block, backend="scaled_mm").float()
    triton_ = w8a8_mm(x, weight, scale, block, backend="triton").float()
    # bf16's rounding of two sums, and the per-channel Triton kernel's FP8 accumulation (see
    # test_the_w8a8_product_is_the_dequantized_fp8_operands_product)
    assert (cublas - triton_).norm() / cublas.norm() < 2**-8


def test_block_scaled_mm_takes_only_weights_of_whole_fours_of_k_blocks() -> None:
    """cuBLAS's block-scaled product was wrong on an H200 for 2 or 3 blocks along K (even with
    every scale 1), right for 4 and 8: such weights are never sent to it."""
    assert fp8_gemm.block_scaled_mm_fits(4096, 4096) and fp8_gemm.block_scaled_mm_fits(512, 12288)
    assert not fp8_gemm.block_scaled_mm_fits(512, 256)
    assert not fp8_gemm.block_scaled_mm_fits(512, 384)
    assert not fp8_gemm.block_scaled_mm_fits(200, 512)
    weight, scale = fp8_weight(512, 256, (128, 128), seed=1)
    x = activations(8, 256, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match=r"K of 512, not a \(512, 256\) weight"):
        fp8_gemm._block_scaled_mm(x, weight, scale)


@pytest.mark.parametrize("block", BLOCKS)
def test_fp8_linear_runs_weight_only_for_few_rows_and_w8a8_above(
        block: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    weight, scale = fp8_weight(64, 48, block, seed=7)
    monkeypatch.setattr(fp8_gemm, "ROW_KERNEL", True)  # (SLUICE_FP8_ROW_KERNEL=1)
    calls = []
    for name in ("fp8_row_mm", "w8a16_mm", "w8a8_mm"):
        original = getattr(fp8_gemm, name)
        monkeypatch.setattr(fp8_gemm, name,
                            lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    rows = fp8_gemm.WEIGHT_ONLY_MAX_ROWS
    # one row (K a multiple of 16): the one-row kernel of triton_gemm (test_fp8_row_mm.py)
    for m, path in ((1, "fp8_row_mm"), (rows, "fp8_row_mm"), (rows + 1, "w8a8_mm")):
        x = activations(m, 48, torch.bfloat16, seed=m).reshape(1, m, 48)  # any leading dims
        y = fp8_gemm.fp8_linear(x, weight, scale, block)
        assert calls[-1] == path and y.shape == (1, m, 64)
        reference = fp8_linear_reference(x, weight, scale, block)
        # W8A8 rounds the activations to FP8 too: 3 mantissa bits, errors of both signs
        # averaging out over K
        bound = 0.02 if path != "w8a8_mm" else 0.08
        assert (y.float() - reference.float()).abs().max() <= bound * reference.abs().max()


def test_mismatched_scales_and_weights_are_refused() -> None:
    weight, scale = fp8_weight(32, 32, (16, 16), seed=1)
    x = activations(2, 32, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match=r"scale of shape \(2, 2\).*\[32\] expected"):
        w8a16_mm(x, weight, scale, None)
    with pytest.raises(ValueError, match="FP8 weight expected"):
        w8a8_mm(x, weight.to(torch.bfloat16), scale, (16, 16))
    with pytest.raises(ValueError, match="at least 32 wide along K, not 16"):
        w8a8_mm(x, weight, scale, (16, 16))
    with pytest.raises(ValueError, match="does not fit a weight"):
        w8a16_mm(activations(2, 16, torch.bfloat16, 3), weight, scale, (16, 16))


@pytest.mark.skipif(DEVICE != "cuda", reason="Qwen3-8B's shapes take minutes in the interpreter")
@pytest.mark.parametrize("m", [1, 8, 64, 3000])
@pytest.mark.parametrize("block", [(128, 128), None])
def test_qwen3_8b_shapes(m: int, block: tuple[int, int] | None) -> None:
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        weight, scale = fp8_weight(n, k, block, seed=n + k)
        x = activations(m, k, torch.bfloat16, seed=m)
        y = fp8_gemm.fp8_linear(x, weight, scale, block)
        reference = fp8_linear_reference(x, weight, scale, block).float()
        error = (y.float() - reference).norm() / reference.norm()
        assert error < (0.01 if m <= fp8_gemm.WEIGHT_ONLY_MAX_ROWS else 0.05), (n, k, error)


# ---- activations quantized by the norm and SiLU that compute them ---------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [256, 320])
@pytest.mark.parametrize("group", [None, 128])
def test_the_fused_norm_and_silu_quantize_as_quantize_activations_does(
        dtype: torch.dtype, hidden: int, group: int | None) -> None:
    """rms_norm_quant and silu_and_mul_quant: the FP8 values and scales of quantize_activations
    applied to triton_ops' norm (with and without the residual add, whose sum they also
    return) and SiLU-and-mul, bit for bit; 320 channels end inside a group."""
    from sluice.model import triton_ops

    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(6, hidden, generator=generator) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(6, hidden, generator=generator).to(dtype).to(DEVICE)
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype).to(DEVICE)
    for res in (None, residual):
        acts, summed = fp8_gemm.rms_norm_quant(x, res, weight, 1e-6, group)
        if res is None:
            normed = triton_ops.rms_norm(x, weight, 1e-6)
            assert summed is None
        else:
            normed, want_sum = triton_ops.add_rms_norm(x, res, weight, 1e-6)
            assert torch.equal(summed, want_sum)
        q, scale = quantize_activations(normed, group)
        assert acts.dtype == dtype and acts.scale.shape == scale.shape
        assert torch.equal(acts.q.float(), q.float()) and torch.equal(acts.scale, scale)
    gate_up = (torch.randn(6, 2 * hidden, generator=generator) * 2).to(dtype).to(DEVICE)
    acts = fp8_gemm.silu_and_mul_quant(gate_up, group)
    q, scale = quantize_activations(triton_ops.silu_and_mul(gate_up), group)
    assert torch.equal(acts.q.float(), q.float()) and torch.equal(acts.scale, scale)


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_an_fp8_model_with_fused_quantization_gives_the_unfused_hidden_states(
        kind: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """install_fused_ops on a model that keeps FP8 weights: the norms before q/k/v and gate/up
    and the SiLU before down hand their projections FP8 activations (a 15-token prefill and a
    2-token decode step: both W8A8), and the model's hidden states and caches are those of the
    same model quantizing in the projections, exactly."""
    from sluice.attention.backend import get_attention_backend
    from sluice.model.hf_config import load_hf_config
    from sluice.model.loader import load_model
    from sluice.model.tiny import make_tiny_model
    from sluice.worker.compile import install_fp8_ops, install_fused_ops
    from tests.kernels.test_fused_ops import prefill_then_decode

    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    folder = make_tiny_model(str(tmp_path / "m"), arch="qwen3", quantize=f"fp8-{kind}",
                             block_size=(16, 32))
    config = load_hf_config(folder)
    model = load_model(folder, config, torch.float32, torch.device(DEVICE),
                       get_attention_backend("torch_ref"), fp8_weights=True)
    install_fp8_ops(model)
    install_fused_ops(model)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.is_fp8 and layer.input_layernorm.quant_norm_op is not None
    assert layer.post_attention_layernorm.quant_norm_op is not None
    assert layer.mlp.act_fn.quant_op is not None
    calls = {"norm": 0, "silu": 0}
    real_norm, real_silu = fp8_gemm.rms_norm_quant, fp8_gemm.silu_and_mul_quant
    monkeypatch.setattr(fp8_gemm, "rms_norm_quant", lambda *a: calls.__setitem__(
        "norm", calls["norm"] + 1) or real_norm(*a))
    monkeypatch.setattr(fp8_gemm, "silu_and_mul_quant", lambda *a: calls.__setitem__(
        "silu", calls["silu"] + 1) or real_silu(*a))
    got = prefill_then_decode(model, config)
    layers = config.num_hidden_layers
    assert calls == {"norm": 2 * 2 * layers, "silu": 2 * layers}
    for each in model.model.layers:
        each.input_layernorm.quant_norm_op = None
        each.post_attention_layernorm.quant_norm_op = None
        each.mlp.act_fn.quant_op = None
    want = prefill_then_decode(model, config)
    for actual, reference in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert torch.equal(actual, reference)


def test_norms_feeding_blocks_of_no_power_of_two_width_quantize_in_the_projection() -> None:
    """Scale blocks 96 wide (W8A8 takes any multiple of 32): norm_for_fp8 hands the projection
    the norm's plain output, which it quantizes itself; 128 wide: FP8 activations."""
    from sluice.model import triton_ops

    x = torch.randn(8, 192).to(DEVICE)
    weight = torch.ones(192).to(DEVICE)
    for width, fused in ((96, False), (64, True)):
        target = torch.nn.Module()
        target.weight, _ = fp8_weight(64, 192, (32, width), seed=1)
        target.fp8_block = (32, width)
        out = fp8_gemm.norm_for_fp8(x, None, weight, 1e-6, target=target)
        assert isinstance(out, fp8_gemm.QuantizedActivations) == fused
        if not fused:
            assert torch.equal(out, triton_ops.rms_norm(x, weight, 1e-6))


# An H200's shared memory per block (232,448 bytes: the limit Triton reported there).
HOPPER_SHARED_MEMORY = 232_448


@pytest.mark.parametrize("m", [1, 16, 64, 65, 3000])
@pytest.mark.parametrize("block", [(128, 128), None])
def test_w8a8_tiles_fit_hopper_shared_memory(m: int, block: tuple[int, int] | None) -> None:
    """Each pipeline stage of the W8A8 kernel holds one FP8 tile of x and one of W: the stages
    must fit in shared memory (128 x 256 tiles with 256 of K and 3 stages did not, on an
    H200; under the interpreter nothing checks it)."""
    for n, k in [(6144, 4096), (4096, 12288), (512, 512)]:
        c = fp8_gemm.w8a8_config(m, n, k, block)
        assert (c.block_m + c.block_n) * c.block_k * c.num_stages <= HOPPER_SHARED_MEMORY, c


@pytest.mark.skipif(DEVICE != "cuda", reason="the CPU runs every product through Triton")
def test_the_quantization_is_fused_only_before_the_triton_w8a8_kernel() -> None:
    """Up to 64 rows per channel the norm or SiLU quantizes for _w8a8_kernel; above, before
    cuBLAS's row-wise _scaled_mm, fusing was slower on an H200 (TTFT 18.1 against 16.5 ms at
    1,024 tokens), so the projection quantizes."""
    weight, _ = fp8_weight(512, 512, None, seed=1)
    x = activations(4, 512, torch.bfloat16, seed=2)
    assert fp8_gemm.fuses_quantization(64, weight, None, x)
    assert fp8_gemm.takes_quantized(3000, weight, None, x)
    assert not fp8_gemm.fuses_quantization(3000, weight, None, x)
