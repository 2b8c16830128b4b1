"""An 8-bit (float8_e4m3fn) KV cache (`kv_cache_dtype="fp8"`): every Triton path stores what the
torch reference stores (saturated at +-448, round to nearest even) and attends to the same
values, in the model's dtype; the dense attention of a prompt sees its K/V as the cache holds
them; and a tiny Qwen3 with the fused ops gives the reference backend's hidden states over an
8-bit cache. On a CPU the kernels run in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from sluice.attention import triton_backend
from sluice.attention.kv_layout import (
    FP8_E4M3_MAX,
    FP8_E5M2_MAX,
    as_cached,
    is_fp8,
    resolve_kv_cache_dtype,
    to_cache_dtype,
)
from sluice.attention.torch_ref import TorchRefBackend
from sluice.attention.triton import store_kv
from sluice.attention.triton.common import fp8_to_fp16
from sluice.attention.triton_backend import TritonBackend, TritonBackendConfig
from sluice.model import layers, triton_ops
from sluice.worker.compile import install_fused_ops
from tests.kernels.test_fused_ops import (  # noqa: F401 (an autouse fixture)
    EPS,
    assert_same_steps,
    bfloat16_casts_round_to_nearest,
    build_tiny_model,
    cos_sin_cache,
    decode_step,
    prefill_then_decode,
    random,
)
from tests.kernels.test_triton_attention import (
    DEVICES,
    SCENARIOS,
    TOLERANCE,
    Step,
    dense_step,
    make_step,
)

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMATS = pytest.mark.parametrize("fmt", [FP8, E5M2], ids=["e4m3", "e5m2"])
LIMIT = {FP8: FP8_E4M3_MAX, E5M2: FP8_E5M2_MAX}
# A key scaled this much passes the format's range (N(0, 1) entries; in a float16 model the
# largest e5m2 ones become inf, which saturates the same way).
LOUD = {FP8: 1000.0, E5M2: 1e5}
# The values here are larger than the other kernel tests' (the cache's quantized contents are
# scaled by 4): bfloat16 outputs within one ulp.
FP8_TOLERANCE = {torch.float32: TOLERANCE[torch.float32],
                 torch.bfloat16: dict(atol=2e-2, rtol=2**-7),
                 torch.float16: dict(atol=4e-3, rtol=2**-10)}
MODEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def to_fp8_step(step: Step, loud_token: int | None = 0, fmt: torch.dtype = FP8) -> Step:
    """The step over an 8-bit cache of format `fmt` (its random contents quantized); one
    token's key scaled past the 8-bit range, so the stores must saturate."""
    step.kv_cache = to_cache_dtype(step.kv_cache * 4, fmt)
    if loud_token is not None:
        step.key[loud_token] *= LOUD[fmt]
    return step


def assert_fp8_matches_reference(step: Step, backend: TritonBackend) -> None:
    ref_cache = step.kv_cache.clone()
    expected = TorchRefBackend().forward(step.query, step.key, step.value, ref_cache,
                                         step.metadata, 0.25)
    out = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25)
    assert is_fp8(step.kv_cache.dtype) and out.dtype == step.query.dtype
    assert torch.equal(step.kv_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert not torch.isnan(step.kv_cache.float()).any()
    torch.testing.assert_close(out, expected, **FP8_TOLERANCE[step.query.dtype])


def test_the_setting_names_the_cache_dtype():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == FP8
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == FP8
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16) == E5M2
    with pytest.raises(ValueError, match="'int8'"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)


def test_writes_saturate_rather_than_overflow():
    x = torch.tensor([1000.0, -1e6, 447.0, 0.3, float("inf")])
    assert to_cache_dtype(x, FP8).float().tolist() == [448.0, -448.0, 448.0, 0.3125, 448.0]
    x = torch.tensor([1e5, -1e9, 57000.0, 0.3, float("inf"), -float("inf")])
    assert to_cache_dtype(x, E5M2).float().tolist() == [57344.0, -57344.0, 57344.0, 0.3125,
                                                        57344.0, -57344.0]
    assert as_cached(x.to(torch.bfloat16), FP8).dtype == torch.bfloat16
    assert as_cached(x, torch.float32) is x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=str)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@FORMATS
def test_unified_kernel_over_an_fp8_cache_matches_reference(device, dtype, scenario, fmt):
    step = to_fp8_step(make_step(SCENARIOS[scenario], 4, 2, 16, dtype=dtype, device=device,
                                 seed=3), fmt=fmt)
    assert_fp8_matches_reference(step, TritonBackend(TritonBackendConfig(split_kv="never")))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=str)
@FORMATS
def test_split_kv_decode_over_an_fp8_cache_matches_reference(device, dtype, fmt, monkeypatch):
    """... with its own tiles (FP8_SPLIT_TILES), as a 16-bit cache takes SPLIT_TILES."""
    launched = []

    def recording(*args, **kwargs):
        launched.append(args[-1])  # the tiles
        return split_kv(*args, **kwargs)

    split_kv = triton_backend.split_kv_attention
    monkeypatch.setattr(triton_backend, "split_kv_attention", recording)
    step = to_fp8_step(make_step(SCENARIOS["decode"], 8, 2, 16, dtype=dtype, device=device,
                                 seed=4), fmt=fmt)
    backend = TritonBackend(TritonBackendConfig(split_kv="always", num_splits=2))
    assert_fp8_matches_reference(step, backend)
    assert launched == [triton_backend.FP8_SPLIT_TILES] != [triton_backend.SPLIT_TILES]


@triton.jit
def _fp8_to_fp16_kernel(in_ptr, out_ptr):
    offsets = tl.arange(0, 256)
    tl.store(out_ptr + offsets, fp8_to_fp16(tl.load(in_ptr + offsets)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PTX: needs an NVIDIA GPU")
@FORMATS
def test_fp8_to_fp16_converts_every_byte_as_torch_does(fmt):
    """The PTX conversion the kernels use for V on a GPU gives torch's float16, bit for bit
    (signed zeros and subnormals included), for every finite byte; the bytes no write produces
    stay inf and NaN (torch quiets the NaNs' payloads)."""
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).cuda()
    out = torch.empty(256, dtype=torch.float16, device="cuda")
    _fp8_to_fp16_kernel[(1,)](every_byte.view(fmt), out)
    expected = every_byte.view(fmt).to(torch.float16)
    finite = torch.isfinite(expected)
    assert (~finite).sum() == (2 if fmt == FP8 else 8)
    assert torch.equal(out[finite].view(torch.int16), expected[finite].view(torch.int16))
    assert [str(v) for v in out[~finite].tolist()] == [
        str(v) for v in expected[~finite].tolist()]


@pytest.mark.parametrize("device", DEVICES)
@FORMATS
def test_store_kv_saturates_in_an_fp8_cache(device, fmt):
    step = to_fp8_step(make_step([(10, 4), (3, 3)], 2, 2, 4, device=device), loud_token=1,
                       fmt=fmt)
    step.value[2] *= -LOUD[fmt]
    expected = step.kv_cache.clone()
    real = step.metadata.slot_mapping >= 0
    slots = step.metadata.slot_mapping[real]
    flat = expected.view(2, -1, 2, 16)
    flat[0, slots] = to_cache_dtype(step.key[real], fmt)
    flat[1, slots] = to_cache_dtype(step.value[real], fmt)
    store_kv(step.key, step.value, step.kv_cache, step.metadata.slot_mapping)
    assert torch.equal(step.kv_cache.view(torch.uint8), expected.view(torch.uint8))
    by_slot = step.kv_cache.view(2, -1, 2, 16)
    assert by_slot[0, slots[1]].float().abs().max() == LIMIT[fmt]
    assert by_slot[1, slots[2]].float().abs().max() == LIMIT[fmt]


@pytest.mark.parametrize("device", DEVICES)
@FORMATS
def test_dense_prefill_attends_to_the_prompt_as_an_fp8_cache_holds_it(device, fmt):
    """The dense path's fresh K/V are rounded as the cache rounds them, so it equals paged
    attention over the 8-bit cache (the reference's)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    step = to_fp8_step(dense_step(37, 11, 4, 2, dtype, device), loud_token=None, fmt=fmt)
    ref_cache = step.kv_cache.clone()
    expected = TorchRefBackend().forward(step.query, step.key, step.value, ref_cache,
                                         step.metadata, 0.25)
    out = TritonBackend().forward(step.query, step.key, step.value, step.kv_cache,
                                  step.metadata, 0.25)
    assert torch.equal(step.kv_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(out[:37], expected[:37], **TOLERANCE[dtype])
    # Not the attention over the unrounded K/V: the rounding is what the check sees.
    exact = TorchRefBackend().forward(step.query, step.key, step.value,
                                      torch.zeros_like(ref_cache, dtype=dtype), step.metadata,
                                      0.25)
    assert not torch.allclose(out[:37], exact[:37], **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@FORMATS
def test_qk_norm_rope_store_kv_writes_fp8_and_leaves_kv_as_cached(dtype, fmt):
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 4
    num_tokens = 7
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random(num_tokens, width, dtype=dtype, seed=30, scale=2.0)
    qkv[2] *= LOUD[fmt] / 2  # past the 8-bit range before the k norm: v saturates
    positions = torch.arange(num_tokens, device=qkv.device) * 3
    slot_mapping = torch.tensor([5, 9, 2, -1, 14, 0, 7], device=qkv.device)
    q_weight = random(head_dim, dtype=dtype, seed=31, scale=0.3) + 1
    k_weight = random(head_dim, dtype=dtype, seed=32, scale=0.3) + 1
    args = (positions, cos_sin_cache(head_dim), q_weight, k_weight, EPS, num_heads, num_kv_heads)
    cache = torch.zeros(2, 4, block_size, num_kv_heads, head_dim, dtype=fmt, device=qkv.device)
    expected_qkv = qkv.clone()
    _, k = layers.qk_norm_rope(expected_qkv, *args)
    v = expected_qkv[:, (num_heads + num_kv_heads) * head_dim:]
    _, _, stored = triton_ops.qk_norm_rope_store_kv(qkv, *args, cache, slot_mapping, None, EPS)
    assert stored
    real = slot_mapping >= 0
    by_slot = cache.view(2, -1, num_kv_heads, head_dim)
    for which, rows in ((0, k), (1, v)):
        expected = to_cache_dtype(rows.reshape(num_tokens, num_kv_heads, head_dim)[real], fmt)
        got = by_slot[which, slot_mapping[real]]
        # float32: the same values; bfloat16 k: torch and the kernel may round a few k values
        # one bfloat16 ulp apart, which may land one 8-bit step apart.
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-3, atol=2**-9)
        assert (got.view(torch.uint8) != expected.view(torch.uint8)).float().mean() < 0.02
    assert by_slot[1, slot_mapping[2]].float().abs().max() == LIMIT[fmt]
    # qkv's k and v now hold what the cache holds (dense prefill reads them there); q does not.
    kv_columns = qkv[:, num_heads * head_dim:].reshape(num_tokens, 2, num_kv_heads, head_dim)
    for which in (0, 1):
        assert torch.equal(kv_columns[real, which], by_slot[which, slot_mapping[real]].to(dtype))
    assert not torch.equal(qkv[:, :num_heads * head_dim],
                           as_cached(qkv[:, :num_heads * head_dim], fmt))


@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=str)
@FORMATS
def test_decode_from_qkv_over_an_fp8_cache(dtype, fmt):
    """The fused decode kernel stores k/v as the cache holds them and attends to the new key
    rounded the same way: what qk_norm_rope and the reference backend over the 8-bit cache
    give."""
    from sluice.attention.triton.decode_qkv import decode_from_qkv
    from sluice.attention.triton_backend import DECODE_TILES

    num_heads, num_kv_heads, head_dim = 4, 2, 32
    seq_lens = [9, 0, 40, 16, 1, 23]
    metadata, cache = decode_step(seq_lens, num_kv_heads, head_dim, 4, dtype, seed=40)
    cache = to_cache_dtype(cache, fmt)
    num_tokens = len(seq_lens)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random(num_tokens, width, dtype=dtype, seed=41, scale=2.0)
    qkv[0, (num_heads + num_kv_heads) * head_dim:] *= LOUD[fmt]  # a v past the 8-bit range
    positions = torch.tensor([max(s - 1, 0) for s in seq_lens], device=qkv.device)
    q_weight = random(head_dim, dtype=dtype, seed=42, scale=0.3) + 1
    k_weight = random(head_dim, dtype=dtype, seed=43, scale=0.3) + 1
    table = cos_sin_cache(head_dim)
    scale = head_dim**-0.5
    expected_qkv, expected_cache = qkv.clone(), cache.clone()
    q, k = layers.qk_norm_rope(expected_qkv, positions, table, q_weight, k_weight, EPS,
                               num_heads, num_kv_heads)
    v = expected_qkv[:, (num_heads + num_kv_heads) * head_dim:]
    expected = TorchRefBackend().forward(
        q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim),
        v.reshape(num_tokens, num_kv_heads, head_dim), expected_cache, metadata, scale)
    out = decode_from_qkv(qkv, positions, table, q_weight, k_weight, EPS, None, EPS, num_heads,
                          cache, metadata, scale, DECODE_TILES)
    torch.testing.assert_close(cache.float(), expected_cache.float(), rtol=2**-3, atol=2**-9)
    assert (cache.view(torch.uint8) != expected_cache.view(torch.uint8)).float().mean() < 0.01
    assert cache.float().abs().max() == LIMIT[fmt]
    tolerance = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=0)
    torch.testing.assert_close(out, expected.reshape(num_tokens, -1), **tolerance)


@pytest.mark.parametrize("fused_decode,fmt", [(False, FP8), (True, FP8), (True, E5M2)],
                         ids=["two_launches", "one_launch", "one_launch_e5m2"])
def test_qwen3_over_an_fp8_cache_gives_the_reference_hidden_states(monkeypatch, fused_decode,
                                                                   fmt):
    """A tiny Qwen3, prefill then decode, over 8-bit caches: with the Triton backend and the
    fused ops (norms folded; the decode step in decode_from_qkv or not) the hidden states and
    caches are the reference backend's with torch ops; and not those over a float32 cache."""
    from sluice.attention import triton_backend

    reference, config = build_tiny_model("qwen3", TorchRefBackend())
    expected = prefill_then_decode(reference, config, cache_dtype=fmt)
    unquantized = prefill_then_decode(reference, config)
    model, _ = build_tiny_model("qwen3", TritonBackend())
    install_fused_ops(model)
    model.model.folded_above_tokens = 0
    if fused_decode:
        monkeypatch.setattr(triton_backend, "FUSED_DECODE_MIN_REQS", 2)
    got = prefill_then_decode(model, config, cache_dtype=fmt)
    hidden = lambda steps: (steps[0], [c.float() for c in steps[1]])  # noqa: E731
    assert_same_steps(hidden(got), hidden(expected), tolerance=1e-3)
    decode_gap = (expected[0][1] - unquantized[0][1]).abs().max()
    assert decode_gap > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_a_float32_model_over_an_fp8_cache_sizes_its_tiles_as_float32(monkeypatch, device):
    """Its K/V tiles enter the dots as float32: shared memory is planned for 4-byte elements
    (the prefill tiles of large heads shrink), not for the cache's 1-byte ones."""
    from sluice.attention.triton import split_kv, unified

    sizes = []
    for module in (unified, split_kv):
        real = module.fit_tiles
        monkeypatch.setattr(module, "fit_tiles", lambda *args, real=real, **kw: (
            sizes.append(args[3]) or real(*args, **kw)))
    for split in ("never", "always"):
        step = to_fp8_step(make_step(SCENARIOS["decode"], 4, 2, 16, seed=5, device=device),
                           loud_token=None)
        assert_fp8_matches_reference(step, TritonBackend(TritonBackendConfig(split_kv=split)))
    assert sizes and set(sizes) == {4}
