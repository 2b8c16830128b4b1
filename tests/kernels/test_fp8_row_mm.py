"""FP8 weights in sluice.model.triton_gemm's one-row kernel (fp8_gemm.fp8_row_mm): the product
against x times the float64-dequantized weight, for scales per output row and per block, with
split-K, the SiLU-and-mul prologue, the ACCUMULATE and 1 / rms epilogues and an N that is not a
multiple of the tiles; and fp8_linear's one-row routing. On a CPU in Triton's interpreter
(conftest.py)."""

from __future__ import annotations

import pytest
import torch

from sluice.model import fp8_gemm
from sluice.model.fp8_gemm import fp8_row_config, fp8_row_mm
from sluice.model.quantization import dequantize_stored, fp8_linear_reference
from sluice.model.triton_gemm import GemmConfig
from tests.kernels.test_fp8_gemm import DEVICE, activations, fp8_weight

BLOCKS = [(16, 32), (32, 32), None]


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul as the kernels round it: silu(gate) in x's dtype, times up, rounded."""
    gate, up = x.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate).to(x.dtype).float()
    return (act * up).to(x.dtype)


def expected(x, weight, scale, block, silu_mul=False):
    if silu_mul:
        x = silu_and_mul_reference(x)
    return x.double() @ dequantize_stored(weight, scale, block, torch.float64).T


def close(actual, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(actual.double(), want, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(actual.float(), want.float(), rtol=2**-7, atol=2e-2)


CONFIGS = [
    None,  # fp8_row_config's
    GemmConfig(4, 1, 32, 4, 1, 1, fma=True),  # plain loop, K over several iterations
    GemmConfig(4, 1, 64, 4, 2, 2, fma=True),  # split-K in two, tiles loaded ahead
    GemmConfig(2, 1, 16, 4, 1, 4, fma=True),  # split-K in four, a K step inside a block
    GemmConfig(8, 1, 128, 4, 3, 1, fma=True),  # one iteration over several K blocks
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
def test_the_fp8_row_product_is_x_times_the_dequantized_weight(block, dtype, config) -> None:
    n, k = 93, 256  # N odd: the last program's rows partly out of range
    weight, scale = fp8_weight(n, k, block, seed=1)
    x = activations(1, k, dtype, seed=2)
    if config is not None and block is not None and block[0] % config.block_n:
        pytest.skip("tiles across block rows are refused (test below)")
    actual = fp8_row_mm(x, weight, scale, block, config)
    assert actual.dtype == dtype and actual.shape == (1, n)
    close(actual, expected(x, weight, scale, block), dtype)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
def test_silu_mul_prologue_and_accumulate(block, dtype, split) -> None:
    n, k = 45, 128
    weight, scale = fp8_weight(n, k, block, seed=3)
    x = activations(1, 2 * k, dtype, seed=4) * 0.2
    config = GemmConfig(2, 1, 32, 4, 2, split, fma=True)
    close(fp8_row_mm(x, weight, scale, block, config, silu_mul=True),
          expected(x, weight, scale, block, silu_mul=True), dtype)
    residual = activations(1, n, dtype, seed=5)
    out = residual.clone()
    fp8_row_mm(x, weight, scale, block, config, silu_mul=True, out=out, accumulate=True)
    close(out, residual.double() + expected(x, weight, scale, block, silu_mul=True), dtype)
    # plain x accumulated, the next call finding the split-K counters reset
    x = activations(1, k, dtype, seed=6)
    out = residual.clone()
    fp8_row_mm(x, weight, scale, block, config, out=out, accumulate=True)
    close(out, residual.double() + expected(x, weight, scale, block), dtype)


@pytest.mark.parametrize("block", BLOCKS)
def test_inv_rms_epilogue_scales_by_the_unscaled_rows_rms(block) -> None:
    n, k, eps = 40, 128, 1e-6
    weight, scale = fp8_weight(n, k, block, seed=7)
    x = activations(1, k, torch.float32, seed=8)
    actual = fp8_row_mm(x, weight, scale, block, inv_rms_eps=eps)
    inv_rms = 1 / torch.sqrt(x.double().pow(2).mean(dim=1, keepdim=True) + eps)
    close(actual, expected(x, weight, scale, block) * inv_rms, torch.float32)


def test_tiles_across_block_rows_and_bad_scales_are_refused() -> None:
    weight, scale = fp8_weight(40, 64, (8, 16), seed=9)
    x = activations(1, 64, torch.float32, seed=10)
    with pytest.raises(ValueError, match="does not fit 8x16 scale blocks"):
        fp8_row_mm(x, weight, scale, (8, 16), GemmConfig(16, 1, 32, 4, 1, 1, fma=True))
    with pytest.raises(ValueError, match="needs float32 scales"):
        fp8_row_mm(x, weight, scale[:2], (8, 16))
    with pytest.raises(ValueError, match="only in the one-row kernel"):
        fp8_row_mm(x, weight, scale, (8, 16), GemmConfig(16, 16, 32, 4, 1))
    # fp8_row_config keeps a program's rows in one block row
    assert fp8_row_config(40, 64, (2, 16)).block_n == 2
    assert fp8_row_config(40, 64, (8, 16), silu_mul=True).block_n == 2


def test_fp8_row_config_doubles_the_bf16_k_step() -> None:
    """The untuned rule: bf16's one-row tiles (triton_gemm.choose_config) with BLOCK_K doubled,
    up to 4,096, where K has that factor; K not a multiple of 16 goes to the weight-only
    kernel."""
    from sluice.model.triton_gemm import choose_config

    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        bf16 = choose_config(1, n, k)
        fp8 = fp8_row_config(n, k, (128, 128))
        assert fp8.block_k == min(4096, 2 * bf16.block_k) and fp8.split_k == 1
        assert fp8.block_n == bf16.block_n and fp8.fma and fp8.block_m == 1
    assert fp8_row_config(4096, 12288, None, silu_mul=True).block_n == 2
    assert fp8_row_config(1024, 3072, None).block_k == 1024  # 3 x 1,024: no factor 2,048
    assert fp8_row_config(96, 72, None) is None


@pytest.mark.parametrize("block", BLOCKS)
def test_fp8_linear_runs_one_row_in_the_row_kernel(block, monkeypatch) -> None:
    """With SLUICE_FP8_ROW_KERNEL=1; by default one row runs _w8a16_kernel (slower on an
    H200: fp8_gemm.ROW_KERNEL)."""
    calls = []
    for name in ("fp8_row_mm", "w8a16_mm", "w8a8_mm"):
        original = getattr(fp8_gemm, name)
        monkeypatch.setattr(fp8_gemm, name,
                            lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    cases = [(64, 1, "fp8_row_mm", True), (72, 1, "w8a16_mm", True), (64, 2, "w8a8_mm", True),
             (64, 1, "w8a16_mm", False)]
    for k, m, path, row_kernel in cases:
        monkeypatch.setattr(fp8_gemm, "ROW_KERNEL", row_kernel)
        weight, scale = fp8_weight(48, k, block, seed=k)
        x = activations(m, k, torch.bfloat16, seed=m).reshape(1, m, k)
        y = fp8_gemm.fp8_linear(x, weight, scale, block)
        assert calls[-1] == path and y.shape == (1, m, 48)
        reference = fp8_linear_reference(x, weight, scale, block)
        bound = 0.08 if path == "w8a8_mm" else 0.02
        assert (y.float() - reference.float()).abs().max() <= bound * reference.abs().max()


def test_fp8_silu_mul_linear_runs_at_one_row_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.model.linear import RowParallelLinear

    monkeypatch.setattr(fp8_gemm, "ROW_KERNEL", True)

    layer = RowParallelLinear(64, 40).to(DEVICE)
    layer.use_fp8((8, 32))
    weight, scale = fp8_weight(40, 64, (8, 32), seed=11)
    layer.weight.data.copy_(weight)
    layer.weight_scale.copy_(scale)
    x = activations(1, 128, torch.bfloat16, seed=12) * 0.2
    y = fp8_gemm.fp8_silu_mul_linear(x, layer)
    close(y, expected(x, weight, scale, (8, 32), silu_mul=True), torch.bfloat16)
    assert fp8_gemm.fp8_silu_mul_linear(activations(2, 128, torch.bfloat16, 13), layer) is None
    monkeypatch.setattr(fp8_gemm, "ROW_KERNEL", False)  # the default: SiLU op, then down
    assert fp8_gemm.fp8_silu_mul_linear(x, layer) is None


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_an_fp8_model_s_one_token_step_runs_down_with_the_silu_prologue(
        kind: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """install_fp8_ops on a tiny FP8 Qwen3 (bf16): a one-token decode step runs every
    projection in the one-row kernel and each down_proj with SiLU-and-mul in its prologue
    (no activation op), giving the hidden states of the same step through the previous
    one-row path (_w8a16_kernel, then the SiLU op and _w8a16_kernel for down) to bf16
    rounding; the prefill (5 rows: W8A8) is the same in both."""
    from sluice.attention.backend import get_attention_backend
    from sluice.model.hf_config import load_hf_config
    from sluice.model.loader import load_model
    from sluice.model.tiny import make_tiny_model
    from sluice.worker.compile import install_fp8_ops
    from tests.kernels.test_fused_ops import (
        BLOCK_SIZE,
        BLOCKS_PER_REQUEST,
        attention_layers,
        bind_kv_caches,
        step_metadata,
    )

    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    monkeypatch.setattr(fp8_gemm, "ROW_KERNEL", True)  # (SLUICE_FP8_ROW_KERNEL=1)
    folder = make_tiny_model(str(tmp_path / "m"), arch="qwen3", quantize=f"fp8-{kind}",
                             block_size=(16, 32))
    config = load_hf_config(folder)
    model = load_model(folder, config, torch.bfloat16, torch.device(DEVICE),
                       get_attention_backend("torch_ref"), fp8_weights=True)

    def one_token_step() -> torch.Tensor:
        shape = (2, BLOCKS_PER_REQUEST, BLOCK_SIZE, config.num_key_value_heads,
                 config.head_dim)
        bind_kv_caches(model, {name: torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
                               for name in attention_layers(model)})
        ids = torch.randint(0, config.vocab_size, (6,),
                            generator=torch.Generator().manual_seed(3)).to(DEVICE)
        with torch.no_grad():
            model(ids[:5], torch.arange(5, device=DEVICE), step_metadata([5], [5]))
            return model(ids[5:], torch.tensor([5], device=DEVICE), step_metadata([1], [6]))

    install_fp8_ops(model)
    mlp = model.model.layers[0].mlp
    assert mlp.fp8_act_down_op is fp8_gemm.fp8_silu_mul_linear
    with monkeypatch.context() as patch:
        patch.setattr(fp8_gemm, "fp8_row_config", lambda *a, **kw: None)
        want = one_token_step()
    calls = {"row": 0, "silu": 0}
    real_row = fp8_gemm.fp8_row_mm
    monkeypatch.setattr(fp8_gemm, "fp8_row_mm", lambda *a, **kw: calls.__setitem__(
        "row", calls["row"] + 1) or real_row(*a, **kw))
    for layer in model.model.layers:
        act = layer.mlp.act_fn
        act.forward = lambda *a, _f=act.forward, **kw: calls.__setitem__(
            "silu", calls["silu"] + 1) or _f(*a, **kw)
    got = one_token_step()  # the prefill's 5 rows run W8A8 and the SiLU op
    layers = config.num_hidden_layers
    # prefill: none; decode: qkv, o, gate_up, down a layer
    assert calls == {"row": 4 * layers, "silu": layers}
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
def test_an_input_gain_is_an_rms_norm_weight_kept_out_of_the_fp8_weight(
        block, dtype, split) -> None:
    """gain [K]: the product of x * gain; with 1 / rms (no split), rms_norm(x, gain) W^T with
    the rms of x; accumulated into out too (split-K)."""
    n, k, eps = 37, 128, 1e-6
    weight, scale = fp8_weight(n, k, block, seed=14)
    x = activations(1, k, dtype, seed=15)
    gain = (torch.rand(k, generator=torch.Generator().manual_seed(16)) + 0.5).to(dtype)
    gain = gain.to(DEVICE)
    config = GemmConfig(2, 1, 32, 4, 2, split, fma=True)
    gained = x.double() * gain.double()
    want = gained @ dequantize_stored(weight, scale, block, torch.float64).T
    close(fp8_row_mm(x, weight, scale, block, config, gain=gain), want, dtype)
    residual = activations(1, n, dtype, seed=17)
    out = residual.clone()
    fp8_row_mm(x, weight, scale, block, config, gain=gain, out=out, accumulate=True)
    close(out, residual.double() + want, dtype)
    if split == 1:
        inv_rms = 1 / torch.sqrt(x.double().pow(2).mean(dim=1, keepdim=True) + eps)
        close(fp8_row_mm(x, weight, scale, block, config, gain=gain, inv_rms_eps=eps),
              want * inv_rms, dtype)
    with pytest.raises(ValueError, match="a gain takes"):
        fp8_row_mm(activations(1, 2 * k, dtype, 18), weight, scale, block, config,
                   silu_mul=True, gain=gain)
