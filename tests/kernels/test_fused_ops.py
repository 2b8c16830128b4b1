"""The fused Triton ops (sluice.model.triton_ops) compute what their torch versions in
sluice.model.layers compute: float32 within float32 rounding, bfloat16 bit for bit under the
interpreter (the kernels round where torch rounds); on a GPU, approximate rsqrt / exp and another
summation order may move a bfloat16 value across a rounding boundary now and then, so there a
few values may differ by about one unit in the last place. The q/k-norm + RoPE variant that
also stores k and v in the paged KV cache writes exactly what store_kv would. And a tiny Qwen3
and Llama give the same hidden states and caches with the fused ops installed as without.

On a CPU the kernels run in Triton's interpreter (see conftest.py), so shapes stay tiny.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton.language as tl

from sluice.attention import triton_backend
from sluice.attention.backend import AttentionBackend
from sluice.attention.metadata import AttentionMetadata
from sluice.attention.torch_ref import TorchRefBackend
from sluice.attention.triton.store_kv import store_kv
from sluice.attention.triton_backend import TritonBackend
from sluice.model import layers, triton_gemm, triton_ops
from sluice.model.attention import attention_layers, bind_kv_caches
from sluice.model.hf_config import HFModelConfig, parse_hf_config
from sluice.model.registry import get_model_class
from sluice.worker.compile import install_fused_ops
from tests.tiny_models import TINY_DIMS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_POSITIONS = 4096
EPS = 1e-6


@pytest.fixture(autouse=True)
def bfloat16_casts_round_to_nearest(monkeypatch):
    """Triton 3.6's interpreter truncates float32 -> bfloat16 casts, where GPUs and torch round
    to nearest even; without this, every rounding step would differ from torch by design."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def convert_rounding_to_nearest(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            bits = np.frombuffer(input.tobytes(), dtype=np.uint32)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # ties to even; inf stays inf
            return rounded.astype(np.uint16).reshape(np.shape(input))
        return convert(input, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert_rounding_to_nearest)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    if DEVICE == "cpu":
        assert torch.equal(actual, expected), f"{(actual != expected).sum()} values differ"
        return
    # One bfloat16 ulp is at most 2**-7 of the value; the absolute part covers sums that cancel.
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-7)
    assert (actual != expected).float().mean() < 0.01


def random(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=generator)).to(dtype).to(DEVICE)


def cos_sin_cache(head_dim: int) -> torch.Tensor:
    rotary = layers.RotaryEmbedding(head_dim, MAX_POSITIONS, base=10000.0)
    return rotary.cos_sin_cache.to(DEVICE)


# (num_heads, num_kv_heads, head_dim): GQA groups of 1, 2 and 4.
HEAD_SHAPES = [(2, 2, 16), (4, 2, 32), (4, 1, 64)]
DTYPES = [torch.float32, torch.bfloat16]


def check_qk_norm_rope(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    with_norm: bool, with_residual: bool = False,
) -> None:
    """With a residual (the input norm folded into the projection): q, k and v scaled by each
    token's 1 / rms(residual row) first, v rewritten in place."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random(num_tokens, width, dtype=dtype, seed=0, scale=2.0)
    # Ragged positions, up to the end of the table.
    generator = torch.Generator().manual_seed(1)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=generator)
    positions[0] = MAX_POSITIONS - 1
    positions = positions.to(DEVICE)
    q_weight = random(head_dim, dtype=dtype, seed=2, scale=0.3) + 1 if with_norm else None
    k_weight = random(head_dim, dtype=dtype, seed=3, scale=0.3) + 1 if with_norm else None
    table = cos_sin_cache(head_dim)
    args = (positions, table, q_weight, k_weight, EPS, num_heads, num_kv_heads)

    # 48 wide: the row's load is masked (64 lanes)
    residual = random(num_tokens, 48, dtype=dtype, seed=9, scale=3.0) if with_residual else None
    expected_qkv = qkv.clone()
    expected_q, expected_k = layers.qk_norm_rope(expected_qkv, *args, residual, EPS)
    fused = qkv.clone()
    q, k = triton_ops.qk_norm_rope(fused, *args, residual=residual, residual_eps=EPS)

    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    # In place: q and k are views of the buffer, whose v columns are untouched (scaled with a
    # residual).
    assert q.data_ptr() == fused.data_ptr() and q.stride() == fused.stride()
    assert k.data_ptr() == fused[:, num_heads * head_dim :].data_ptr()
    v_start = (num_heads + num_kv_heads) * head_dim
    assert_matches(fused[:, v_start:], expected_qkv[:, v_start:])
    assert torch.equal(fused[:, v_start:], qkv[:, v_start:]) == (not with_residual)


@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=lambda s: "h{}_kvh{}_d{}".format(*s))
def test_qk_norm_rope_matches_torch(head_shape, dtype, with_norm):
    # 13 tokens: a program is one (token, head), so more tokens only repeat programs (under the
    # interpreter, 37 took 3.3 s a case).
    check_qk_norm_rope(13, *head_shape, dtype, with_norm)


@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=lambda s: "h{}_kvh{}_d{}".format(*s))
def test_qk_norm_rope_with_folded_input_norm_matches_torch(head_shape, dtype, with_norm):
    check_qk_norm_rope(13, *head_shape, dtype, with_norm, with_residual=True)


@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=lambda s: "h{}_kvh{}_d{}".format(*s))
def test_qk_norm_rope_single_token(head_shape):
    check_qk_norm_rope(1, *head_shape, torch.bfloat16, with_norm=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_shape", [(4, 2, 32), (6, 2, 16)],
                         ids=lambda s: "h{}_kvh{}_d{}".format(*s))
def test_qk_norm_rope_several_heads_per_program(monkeypatch, head_shape, dtype):
    """The prefill grid: head blocks of up to 8 heads, partly masked when a block runs past the
    q or k heads (6 q heads in a block of 8)."""
    monkeypatch.setattr(triton_ops, "ONE_HEAD_PER_PROGRAM_BELOW", 0)
    assert triton_ops.heads_per_program(37, *head_shape[:2]) > 1
    check_qk_norm_rope(37, *head_shape, dtype, with_norm=True)
    check_qk_norm_rope(37, *head_shape, dtype, with_norm=True, with_residual=True)


def check_qk_norm_rope_store_kv(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    cache_dtype: torch.dtype, block_size: int, with_residual: bool = False,
) -> None:
    """Against the unfused pair (qk_norm_rope, then store_kv of its k and qkv's v) on a cache of
    random contents: 11 tokens, two of them padding (slot -1), slot_mapping longer than the
    batch (entries past it must not be stored), slots scattered over the blocks. With a
    residual, the v stored is the scaled one."""
    num_tokens, num_blocks = 11, 5
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random(num_tokens, width, dtype=dtype, seed=10, scale=2.0)
    generator = torch.Generator().manual_seed(11)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=generator).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[: num_tokens + 3]
    slots[[3, num_tokens - 1]] = -1
    slot_mapping = slots.to(DEVICE)
    q_weight = random(head_dim, dtype=dtype, seed=12, scale=0.3) + 1
    k_weight = random(head_dim, dtype=dtype, seed=13, scale=0.3) + 1
    args = (positions, cos_sin_cache(head_dim), q_weight, k_weight, EPS, num_heads, num_kv_heads)
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = random(*cache_shape, dtype=cache_dtype, seed=14)
    residual = random(num_tokens, 40, dtype=dtype, seed=16, scale=3.0) if with_residual else None

    expected_qkv, expected_cache = qkv.clone(), kv_cache.clone()
    _, k = triton_ops.qk_norm_rope(expected_qkv, *args, residual=residual, residual_eps=EPS)
    v = expected_qkv[:, (num_heads + num_kv_heads) * head_dim :]
    kv_shape = (num_tokens, num_kv_heads, head_dim)
    store_kv(k.view(kv_shape), v.view(kv_shape), expected_cache, slot_mapping)
    fused_qkv, fused_cache = qkv.clone(), kv_cache.clone()
    q, k, stored = triton_ops.qk_norm_rope_store_kv(fused_qkv, *args, fused_cache, slot_mapping,
                                                    residual, EPS)

    assert stored
    assert torch.equal(fused_qkv, expected_qkv)
    assert q.data_ptr() == fused_qkv.data_ptr()
    assert torch.equal(fused_cache, expected_cache)
    # What store_kv writes, spelled out: the batch's k and v at their slots, the rest as it was.
    real = slots[:num_tokens] >= 0
    written = slots[:num_tokens][real]
    for cache, before, rows in ((fused_cache[0], kv_cache[0], k), (fused_cache[1], kv_cache[1], v)):
        by_slot = cache.reshape(-1, num_kv_heads, head_dim).cpu()
        assert torch.equal(by_slot[written], rows.view(kv_shape).cpu()[real].to(cache_dtype))
        untouched = torch.ones(by_slot.shape[0], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(by_slot[untouched], before.reshape(by_slot.shape).cpu()[untouched])


F32, BF16 = torch.float32, torch.bfloat16
# Each GQA group (1, 2, 4) with both block sizes, each pair of (qkv, cache) dtypes twice.
STORE_CASES = [
    ((2, 2, 16), F32, F32, 4),
    ((2, 2, 16), BF16, BF16, 16),
    ((4, 2, 32), BF16, BF16, 4),
    ((4, 2, 32), BF16, F32, 16),
    ((4, 1, 64), BF16, F32, 4),
    ((4, 1, 64), F32, F32, 16),
]


@pytest.mark.parametrize(
    "head_shape,dtype,cache_dtype,block_size", STORE_CASES,
    ids=["h{}_kvh{}_d{}-{}-cache_{}-block{}".format(*shape, str(dtype)[6:], str(cache)[6:], block)
         for shape, dtype, cache, block in STORE_CASES],
)
def test_qk_norm_rope_store_kv_writes_what_store_kv_writes(head_shape, dtype, cache_dtype,
                                                           block_size):
    check_qk_norm_rope_store_kv(*head_shape, dtype, cache_dtype, block_size)
    check_qk_norm_rope_store_kv(*head_shape, dtype, cache_dtype, block_size, with_residual=True)


@pytest.mark.parametrize("head_shape", [(4, 2, 32), (6, 3, 16)],
                         ids=lambda s: "h{}_kvh{}_d{}".format(*s))
def test_qk_norm_rope_store_kv_several_heads_per_program(monkeypatch, head_shape):
    """The prefill grid: k and v blocks of up to 8 heads, partly masked (3 k or v heads in a
    block of 8)."""
    monkeypatch.setattr(triton_ops, "ONE_HEAD_PER_PROGRAM_BELOW", 0)
    assert triton_ops.heads_per_program(11, *head_shape[:2]) > 1
    check_qk_norm_rope_store_kv(*head_shape, torch.bfloat16, torch.bfloat16, block_size=4)
    check_qk_norm_rope_store_kv(*head_shape, torch.bfloat16, torch.bfloat16, block_size=4,
                                with_residual=True)


def test_qk_norm_rope_store_kv_stores_nothing_without_a_cache():
    """Before the cache is bound (a profiling run): the plain op, and attention must store."""
    qkv = random(5, (4 + 2 * 2) * 16, dtype=torch.bfloat16, seed=15)
    positions = torch.arange(5, device=DEVICE)
    args = (positions, cos_sin_cache(16), None, None, EPS, 4, 2)
    expected = qkv.clone()
    triton_ops.qk_norm_rope(expected, *args)
    slot_mapping = torch.arange(5, device=DEVICE)
    _, _, stored = triton_ops.qk_norm_rope_store_kv(qkv, *args, torch.empty(0), slot_mapping)
    assert not stored
    assert torch.equal(qkv, expected)


def test_heads_per_program_one_at_decode_more_at_prefill():
    assert triton_ops.heads_per_program(32, 16, 8) == 1
    assert triton_ops.heads_per_program(128, 16, 8) == 2
    assert triton_ops.heads_per_program(256, 16, 8) == 8
    assert triton_ops.heads_per_program(8192, 16, 8) == 8
    assert triton_ops.heads_per_program(8192, 4, 1) == 4


@pytest.mark.parametrize("intermediate_size", [96, 1100])  # 1100: two blocks, the last partial
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_torch(dtype, num_tokens, intermediate_size):
    # Wide enough to reach silu's saturated tails.
    x = random(num_tokens, 2 * intermediate_size, dtype=dtype, seed=4, scale=4.0)
    assert_matches(triton_ops.silu_and_mul(x), layers.silu_and_mul(x))
    # The post-attention norm folded into gate_up_proj: 1 / rms of a 40-wide residual row.
    residual = random(num_tokens, 40, dtype=dtype, seed=5, scale=3.0)
    scaled = triton_ops.silu_and_mul(x, residual, EPS)
    assert_matches(scaled, layers.silu_and_mul(x, residual, EPS))
    assert not torch.equal(scaled, triton_ops.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_programs_looping_over_blocks(dtype, monkeypatch):
    """A long prompt's programs loop over their whole row (silu_blocks_per_program): here 5
    blocks of 32, the last partial."""
    monkeypatch.setattr(triton_ops, "SILU_BLOCK", 32)
    monkeypatch.setattr(triton_ops, "SILU_ROW_PROGRAM_TOKENS", 3)
    assert triton_ops.silu_blocks_per_program(3, 5) == 5
    x = random(3, 2 * 150, dtype=dtype, seed=6, scale=4.0)
    residual = random(3, 40, dtype=dtype, seed=7, scale=3.0)
    assert_matches(triton_ops.silu_and_mul(x), layers.silu_and_mul(x))
    assert_matches(triton_ops.silu_and_mul(x, residual, EPS),
                   layers.silu_and_mul(x, residual, EPS))


def test_silu_blocks_per_program_a_row_from_1024_tokens():
    assert triton_ops.silu_blocks_per_program(1, 12) == 1  # a decode row: one block a program
    assert triton_ops.silu_blocks_per_program(1023, 12) == 1
    assert triton_ops.silu_blocks_per_program(1024, 12) == 12
    assert triton_ops.silu_blocks_per_program(8192, 3) == 3


@pytest.mark.parametrize("hidden_size", [64, 100])
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_torch(dtype, num_tokens, hidden_size):
    x = random(num_tokens, hidden_size, dtype=dtype, seed=5, scale=3.0)
    residual = random(num_tokens, hidden_size, dtype=dtype, seed=6)
    weight = random(hidden_size, dtype=dtype, seed=7, scale=0.3) + 1
    x_before, residual_before = x.clone(), residual.clone()

    assert_matches(triton_ops.rms_norm(x, weight, EPS), layers.rms_norm(x, weight, EPS))
    normed, summed = triton_ops.add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_sum = layers.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, expected_sum)  # one rounded add, whatever the device
    assert_matches(normed, expected_normed)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_rejects_rows_too_long_for_one_block():
    x = torch.zeros(1, triton_ops.MAX_NORM_SIZE + 1, device=DEVICE)
    with pytest.raises(ValueError, match="hidden size must be at most 32768, got 32769"):
        triton_ops.rms_norm(x, x[0], EPS)


# --- end to end: the models with the fused ops installed -------------------------------------

# tests/tiny_models.py's shape with a smaller vocab and MLP, as config.json fields.
TINY_CONFIG = dict(
    TINY_DIMS,
    vocab_size=128,
    intermediate_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
ARCHS = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
BLOCK_SIZE = 4
BLOCKS_PER_REQUEST = 4


def build_tiny_model(
    model_type: str, backend: AttentionBackend
) -> tuple[torch.nn.Module, HFModelConfig]:
    raw = {**TINY_CONFIG, "architectures": [ARCHS[model_type]], "model_type": model_type}
    config = parse_hf_config(raw)
    with torch.device(DEVICE):
        model = get_model_class(config.architectures)(config, backend)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator).to(DEVICE)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.2 * noise)
    return model, config


def step_metadata(query_lens: list[int], seq_lens: list[int],
                  num_padding: int = 0) -> AttentionMetadata:
    """Request i owns blocks [i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST); the
    `num_padding` tokens past the requests (a CUDA graph's fixed batch) have slot -1."""
    slots: list[int] = []
    for req, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        slots += [req * BLOCKS_PER_REQUEST * BLOCK_SIZE + p
                  for p in range(seq_len - query_len, seq_len)]
    slots += [-1] * num_padding
    query_start_loc = torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)
    seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32)
    block_tables = torch.arange(len(seq_lens) * BLOCKS_PER_REQUEST, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=seq_lens_tensor.to(DEVICE),
        block_tables=block_tables.view(len(seq_lens), -1).to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_tensor,
    )


def prefill_then_decode(
    model: torch.nn.Module, config: HFModelConfig, cache_dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Hidden states of a prefill of two prompts (5 and 8 tokens, then 2 padding tokens) into a
    fresh paged cache of `cache_dtype`, then one decode step each reading it back; and the
    layers' caches after both steps."""
    shape = (2, 2 * BLOCKS_PER_REQUEST, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    kv_caches = {name: torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
                 for name in attention_layers(model)}
    bind_kv_caches(model, kv_caches)
    generator = torch.Generator().manual_seed(8)
    input_ids = torch.randint(0, config.vocab_size, (15,), generator=generator).to(DEVICE)
    prefill_ids = torch.cat([input_ids[:13], input_ids.new_zeros(2)])
    prefill_positions = torch.tensor([*range(5), *range(8), 0, 0], device=DEVICE)
    decode_positions = torch.tensor([5, 8], device=DEVICE)
    with torch.no_grad():
        prefill = model(prefill_ids, prefill_positions, step_metadata([5, 8], [5, 8], 2))
        decode = model(input_ids[13:], decode_positions, step_metadata([1, 1], [6, 9]))
    return [prefill[:13], decode], list(kv_caches.values())


def assert_same_steps(
    got: tuple[list[torch.Tensor], list[torch.Tensor]],
    expected: tuple[list[torch.Tensor], list[torch.Tensor]],
    tolerance: float,
) -> None:
    """Hidden states and KV caches (every slot: padding tokens store nothing) agree."""
    for actual, reference in zip(got[0] + got[1], expected[0] + expected[1], strict=True):
        torch.testing.assert_close(actual, reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_fused_ops_give_the_models_hidden_states(model_type):
    model, config = build_tiny_model(model_type, TorchRefBackend())
    expected = prefill_then_decode(model, config)
    install_fused_ops(model)
    attention = model.model.layers[0].self_attn
    assert attention.qk_norm_rope_op is triton_ops.qk_norm_rope_store_kv
    assert model.model.layers[0].mlp.act_fn.op is triton_ops.silu_and_mul
    # both steps' projections (15 and 2 rows) run in the Triton GEMM
    assert attention.qkv_proj.gemm_op is triton_gemm.linear
    assert model.model.layers[0].mlp.act_down_op is triton_gemm.silu_mul_linear
    got = prefill_then_decode(model, config)
    assert_same_steps(got, expected, tolerance=1e-5)


@pytest.mark.parametrize("model_type", list(ARCHS))
@pytest.mark.parametrize("ops", ["torch", "fused"])
def test_folded_norms_give_the_models_hidden_states(model_type, ops):
    """fold_norms: with the norm weights folded into qkv_proj and gate_up_proj, the folded
    forward (the projections on the raw residual, 1 / rms in the q/k/v and SiLU ops, the
    residual adds in o_proj's and down_proj's GEMMs) and the unfolded one (norms with unit
    weights, the small steps') both give the model's hidden states and caches, with the torch
    ops and with the fused ones."""
    model, config = build_tiny_model(model_type, TorchRefBackend())
    expected = prefill_then_decode(model, config)
    qkv_before = model.model.layers[0].self_attn.qkv_proj.weight.clone()
    if ops == "fused":
        install_fused_ops(model)
        assert model.model.folded_above_tokens == 0  # every step, the Triton GEMM's too
        model.model.folded_above_tokens = 16
    else:
        assert model.model.fold_norms(above_tokens=16)
    layer = model.model.layers[0]
    gain = build_tiny_model(model_type, TorchRefBackend())[0].model.layers[0].input_layernorm
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv_before * gain.weight)
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(gain.weight))
    assert torch.equal(layer.post_attention_layernorm.weight, torch.ones_like(gain.weight))
    assert model.model.fold_norms(above_tokens=0)  # a second call folds nothing twice
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv_before * gain.weight)

    # Steps of 15 and 2 tokens: the unfolded forms (with unit norm weights)...
    assert_same_steps(prefill_then_decode(model, config), expected, tolerance=1e-5)
    # ...and the folded ones, for both steps.
    model.model.folded_above_tokens = 0
    calls = []
    real_forward = type(layer).add_to_residual
    inv_rms_calls = []
    if ops == "fused":  # at these rows gate_up's GEMM applies 1 / rms, the down GEMM the SiLU
        real_op = triton_gemm.inv_rms_linear
        for each in model.model.layers:
            each.mlp.gate_up_proj.inv_rms_gemm_op = (
                lambda *args: inv_rms_calls.append(1) or real_op(*args))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(layer), "add_to_residual",
                      lambda self, *args: calls.append(1) or real_forward(self, *args))
        got = prefill_then_decode(model, config)
    assert len(calls) == 2 * config.num_hidden_layers
    assert len(inv_rms_calls) == (2 * config.num_hidden_layers if ops == "fused" else 0)
    assert_same_steps(got, expected, tolerance=1e-5)


def test_fold_norms_leaves_biased_and_float16_models_alone():
    """A q/k/v bias would be scaled by 1 / rms too, and float16 could overflow on the raw
    residual's products: those models keep their norms."""
    config = parse_hf_config({**TINY_CONFIG, "architectures": ["Qwen2ForCausalLM"],
                              "model_type": "qwen2"})
    with torch.device(DEVICE):
        qwen2 = get_model_class(config.architectures)(config, TorchRefBackend())
    torch.nn.init.normal_(qwen2.model.layers[0].input_layernorm.weight)
    norm_before = qwen2.model.layers[0].input_layernorm.weight.clone()
    assert not qwen2.model.fold_norms(above_tokens=16)
    assert qwen2.model.folded_above_tokens is None
    assert torch.equal(qwen2.model.layers[0].input_layernorm.weight, norm_before)
    llama, _ = build_tiny_model("llama", TorchRefBackend())
    llama.half()
    assert not llama.model.fold_norms(above_tokens=16)


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded_norms"])
def test_triton_attention_reads_the_cache_the_fused_op_stored(monkeypatch, folded):
    """The fused op stores k and v and the Triton backend launches no store of its own: the
    cache it reads, and every hidden state, match the torch ops with the reference backend;
    also with the norms folded (v scaled by the kernel before it is stored)."""
    reference, config = build_tiny_model("qwen3", TorchRefBackend())
    expected = prefill_then_decode(reference, config)
    model, _ = build_tiny_model("qwen3", TritonBackend())
    install_fused_ops(model)
    model.model.folded_above_tokens = 0 if folded else 16
    store_calls = []
    monkeypatch.setattr(triton_backend, "store_kv", lambda *args: store_calls.append(args))
    got = prefill_then_decode(model, config)
    assert store_calls == []
    assert_same_steps(got, expected, tolerance=1e-4)


@pytest.mark.parametrize("fused_decode", [False, True], ids=["two_launches", "one_launch"])
def test_decode_attention_from_the_projection_gives_the_models_hidden_states(monkeypatch,
                                                                            fused_decode):
    """With the norms folded, a decode step hands the raw projection to the Triton backend,
    which norms, rotates and stores k/v inside its decode attention (decode_from_qkv) where its
    rule says so; the prefill step never does. Hidden states and caches match the torch
    ops with the reference backend either way."""
    reference, config = build_tiny_model("qwen3", TorchRefBackend())
    expected = prefill_then_decode(reference, config)
    model, _ = build_tiny_model("qwen3", TritonBackend())
    install_fused_ops(model)
    if fused_decode:  # the decode step has 2 requests, under the rule's minimum
        monkeypatch.setattr(triton_backend, "FUSED_DECODE_MIN_REQS", 2)
        # and on a GPU so small a batch would split its keys (the fused kernel does not)
        monkeypatch.setattr(triton_backend.TritonBackend, "_num_splits", lambda *args: 0)
    fused_calls, rope_calls = [], []
    real_fused, real_rope = triton_backend.decode_from_qkv, triton_ops.qk_norm_rope_store_kv
    monkeypatch.setattr(triton_backend, "decode_from_qkv",
                        lambda *args, **kwargs: fused_calls.append(args[0].shape)
                        or real_fused(*args, **kwargs))
    for layer in model.model.layers:
        layer.self_attn.qk_norm_rope_op = (
            lambda *args: rope_calls.append(args[0].shape) or real_rope(*args))
    got = prefill_then_decode(model, config)
    layers_count = config.num_hidden_layers
    width = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    assert fused_calls == ([(2, width)] * layers_count if fused_decode else [])
    assert rope_calls == [(15, width)] * layers_count + ([] if fused_decode
                                                        else [(2, width)] * layers_count)
    assert_same_steps(got, expected, tolerance=1e-4)


def decode_step(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, seed: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """A decode batch (one query a request; seq_len 0: a CUDA graph's padding request, slot
    -1) over shuffled blocks of a cache of random contents."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-max(s, 1) // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    slots = []
    for i, seq_len in enumerate(seq_lens):
        table = [free.pop() for _ in range(blocks_per_req[i])]
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        last = seq_len - 1
        slots.append(table[last // block_size] * block_size + last % block_size
                     if seq_len else -1)
    seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32)
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=len(seq_lens),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=seq_lens_tensor.to(DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_tensor,
    )
    cache = random(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=seed + 1)
    return metadata, cache


def assert_close_in_dtype(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 within float32 rounding; bfloat16 within an ulp, for a few values (another
    summation order of a head's norm)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=3e-5)
        return
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-7)
    assert (actual != expected).float().mean() < 0.01


# (num_heads, num_kv_heads, head_dim): GQA groups of 1, 2, 3 and 4.
DECODE_QKV_SHAPES = [(2, 2, 16), (4, 2, 32), (6, 2, 16), (4, 1, 64)]


@pytest.mark.parametrize("ordered", [False, True], ids=["in_order", "longest_first"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norms", "folded_norms"])
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_shape", DECODE_QKV_SHAPES,
                         ids=lambda s: "h{}_kvh{}_d{}".format(*s))
def test_decode_from_qkv_is_qk_norm_rope_then_attention(head_shape, dtype, with_norm,
                                                        with_residual, ordered):
    """One launch against the two it replaces, as the torch ops and the reference backend do
    them: the same cache afterwards (the new k and v at their slots, nothing for padding
    requests) and the same attention output (zeros for padding requests); qkv is only read."""
    from sluice.attention.triton.decode_qkv import decode_from_qkv
    from sluice.attention.triton_backend import DECODE_TILES

    num_heads, num_kv_heads, head_dim = head_shape
    block_size = 4
    seq_lens = [9, 0, 40, 16, 1, 0, 23]  # ragged; one fills its block; two padding requests
    metadata, cache = decode_step(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=20)
    if ordered:
        metadata.decode_order = torch.argsort(
            -torch.tensor(seq_lens), stable=True).to(torch.int32).to(DEVICE)
    num_tokens = len(seq_lens)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random(num_tokens, width, dtype=dtype, seed=21, scale=2.0)
    positions = torch.tensor([max(s - 1, 0) for s in seq_lens], device=DEVICE)
    q_weight = random(head_dim, dtype=dtype, seed=22, scale=0.3) + 1 if with_norm else None
    k_weight = random(head_dim, dtype=dtype, seed=23, scale=0.3) + 1 if with_norm else None
    residual = random(num_tokens, 40, dtype=dtype, seed=24, scale=3.0) if with_residual else None
    table = cos_sin_cache(head_dim)
    scale = head_dim**-0.5

    expected_qkv, expected_cache = qkv.clone(), cache.clone()
    q, k = layers.qk_norm_rope(expected_qkv, positions, table, q_weight, k_weight, EPS,
                               num_heads, num_kv_heads, residual, EPS)
    v = expected_qkv[:, (num_heads + num_kv_heads) * head_dim :]
    expected = TorchRefBackend().forward(
        q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim),
        v.reshape(num_tokens, num_kv_heads, head_dim), expected_cache, metadata, scale)
    qkv_before, cache_before = qkv.clone(), cache.clone()
    out = decode_from_qkv(qkv, positions, table, q_weight, k_weight, EPS, residual, EPS,
                          num_heads, cache, metadata, scale, DECODE_TILES)

    assert torch.equal(qkv, qkv_before)
    assert_close_in_dtype(cache, expected_cache)
    changed = (cache != cache_before).flatten(3).any(-1)  # [2, num_blocks, block_size]
    assert int(changed.sum()) == 2 * sum(1 for s in seq_lens if s)  # k and v, real requests
    assert out.shape == (num_tokens, num_heads * head_dim) and out.dtype == dtype
    tolerance = dict(atol=3e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=0)
    torch.testing.assert_close(out, expected.reshape(num_tokens, -1), **tolerance)
    assert torch.all(out[[1, 5]] == 0)


def test_decode_from_qkv_rule_takes_decode_batches_of_about_one_wave():
    """The backend fuses decode batches of FUSED_DECODE_MIN_REQS requests or more whose
    programs fit FUSED_DECODE_MAX_PROGRAMS_PER_SM per SM (4 SMs stand in for the CPU), and
    leaves everything else to the two launches (None)."""
    from sluice.attention.triton_backend import (
        FUSED_DECODE_MAX_PROGRAMS_PER_SM,
        FUSED_DECODE_MIN_REQS,
    )

    backend = TritonBackend()
    head_dim, num_heads = 16, 2
    table = cos_sin_cache(head_dim)
    sms = backend._sm_count(torch.device(DEVICE))

    def fused(num_reqs: int, num_kv_heads: int, **changes) -> bool:
        metadata, cache = decode_step([5] * num_reqs, num_kv_heads, head_dim, 4, torch.float32,
                                      seed=30)
        for name, value in changes.items():
            setattr(metadata, name, value)
        qkv = random(num_reqs, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float32,
                     seed=31)
        positions = torch.full((num_reqs,), 4, device=DEVICE)
        out = backend.decode_from_qkv(qkv, positions, table, None, None, EPS, None, EPS,
                                      num_heads, cache, metadata, 0.25)
        return out is not None

    assert FUSED_DECODE_MIN_REQS == 16
    if DEVICE == "cpu":
        assert sms * FUSED_DECODE_MAX_PROGRAMS_PER_SM == 16
        assert fused(16, 1)
        assert not fused(15, 1)  # too few requests
        assert not fused(16, 2)  # 32 programs: more than a wave
        assert not fused(16, 1, max_query_len=2)  # a verification step
        assert not fused(16, 1, dense_prefill=True)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_decode_from_qkv_takes_the_fused_kernels_own_tiles(monkeypatch, cache_dtype):
    """Where its programs fill FUSED_TILES_MIN_PROGRAMS_PER_SM per SM (4 SMs stand in for a
    CPU), the fused kernel runs with the backend's fused tiles for the cache's dtype (8-bit: 2
    stages), not the unified kernel's tiles for the batch, and gives the same output with
    them; fewer programs keep the unified kernel's tiles."""
    from sluice.attention.triton.common import TileConfig

    chosen = []
    real = triton_backend.decode_from_qkv

    def recording(*args, **kwargs):
        chosen.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_from_qkv", recording)
    head_dim, num_heads, num_kv_heads, num_reqs = 16, 2, 1, 16
    table = cos_sin_cache(head_dim)
    outs = []
    for config in (triton_backend.TritonBackendConfig(),
                   triton_backend.TritonBackendConfig(
                       fused_decode_tiles=TileConfig(16, 32, 4, 2),
                       fp8_fused_decode_tiles=TileConfig(16, 32, 4, 2))):
        backend = TritonBackend(config)
        metadata, cache = decode_step([70] * num_reqs, num_kv_heads, head_dim, 4, torch.float32,
                                      seed=30)
        cache = cache.to(cache_dtype)
        qkv = random(num_reqs, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float32,
                     seed=31)
        positions = torch.full((num_reqs,), 69, device=DEVICE)
        outs.append(backend.decode_from_qkv(qkv, positions, table, None, None, EPS, None, EPS,
                                            num_heads, cache, metadata, 0.25))
    torch.testing.assert_close(outs[0], outs[1], atol=3e-5, rtol=1e-5)
    if DEVICE == "cpu":  # 16 programs on 4 SMs: 4 a SM; 7 requests: under 2 a SM
        fp8 = cache_dtype == torch.float8_e4m3fn
        assert chosen[0] == (triton_backend.FP8_FUSED_DECODE_TILES if fp8
                             else triton_backend.FUSED_DECODE_TILES)
        assert chosen[1] == TileConfig(16, 32, 4, 2)
        backend = TritonBackend()
        assert backend.fused_decode_tiles(8, 70, 1, cache_dtype, torch.device("cpu")) == (
            chosen[0])
        assert backend.fused_decode_tiles(7, 70, 1, cache_dtype, torch.device("cpu")) == (
            backend.decode_plan(7, 1, 70, torch.device("cpu"), cache_dtype)[1])
