"""The fused experts (sluice.model.triton_moe) equal sluice.model.moe.experts_reference (FP8
experts: fp8_experts_reference, the weights dequantized), and the alignment by expert lays
every (token, slot) pair out once, in its expert's blocks.

On a CPU the kernels run in Triton's interpreter (conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sluice.model import triton_moe
from sluice.model.moe import ExpertScales, experts_reference, fp8_experts_reference, route
from sluice.model.quantization import quantize_fp8
from sluice.model.triton_moe import (
    align_by_expert,
    align_by_expert_reference,
    fused_experts,
    fused_route,
)
from tests.kernels.test_fused_ops import bfloat16_casts_round_to_nearest  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(t: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
         seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=generator) * inter**-0.5
    logits = torch.randn(t, experts, generator=generator) * 2
    weights, ids = route(logits.to(dtype), top_k, renormalize=seed % 2 == 0)
    move = lambda v: v.to(DEVICE)  # noqa: E731
    return (move(x.to(dtype)), move(w13.to(dtype)), move(w2.to(dtype)), move(weights),
            move(ids))


@pytest.mark.parametrize("t,experts,top_k", [(1, 4, 2), (7, 8, 2), (40, 8, 3), (300, 6, 2)])
def test_alignment_lays_out_every_pair_once_in_its_expert_s_blocks(t: int, experts: int,
                                                                   top_k: int) -> None:
    ids = case(t, experts, top_k, 16, 16, torch.float32, t)[4]
    for block_m in (16, 64):
        sorted_ids, block_expert = align_by_expert(ids, experts, block_m)
        pairs = t * top_k
        assert sorted_ids.numel() == block_expert.numel() * block_m
        real = sorted_ids[sorted_ids < pairs]
        assert sorted(real.tolist()) == list(range(pairs))  # each pair once
        flat = ids.reshape(-1)
        for position in (sorted_ids < pairs).nonzero().flatten().tolist():
            assert block_expert[position // block_m] == flat[sorted_ids[position]]
        assert (block_expert[block_expert >= 0].diff() >= 0).all()  # runs in expert order


@pytest.mark.parametrize("path", ["pairs", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,experts,top_k,hidden,inter", [
    (1, 4, 2, 32, 16), (5, 8, 2, 64, 32), (33, 8, 3, 48, 40), (130, 6, 2, 32, 16)])
def test_fused_experts_equal_the_reference(t: int, experts: int, top_k: int, hidden: int,
                                           inter: int, dtype: torch.dtype, path: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert's tokens, several experts a token, routing that differs token to token;
    K and N not multiples of the tiles (48, 40), more pairs than one block (130 x 2); through
    the pair kernel (no alignment) and the grouped GEMM, whichever the pair count would pick."""
    monkeypatch.setattr(triton_moe, "PAIR_KERNEL_MAX_PAIRS", 10**6 if path == "pairs" else 0)
    if path == "pairs" and t * top_k > 16:
        pytest.skip("the pair kernel is for few pairs (PAIR_KERNEL_MAX_PAIRS)")
    x, w13, w2, weights, ids = case(t, experts, top_k, hidden, inter, dtype, t)
    assert len(torch.unique(ids)) > 1
    got = fused_experts(x, w13, w2, weights, ids)
    want = experts_reference(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (t, hidden)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the reference rounds the down projection before its weight, and sums in bf16
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)


def test_no_tokens_give_no_rows() -> None:
    x, w13, w2, weights, ids = case(3, 4, 2, 32, 16, torch.float32, 0)
    assert fused_experts(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


def test_few_pairs_take_the_pair_kernel_and_many_the_grouped_gemm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 1 and 2 of 8 experts a token need no alignment; 3 tokens (24 pairs) do."""
    aligned = []
    real = triton_moe.align_by_expert
    monkeypatch.setattr(triton_moe, "align_by_expert",
                        lambda *a: aligned.append(a[0].shape) or real(*a))
    for t in (1, 2, 3):
        x, w13, w2, weights, ids = case(t, 16, 8, 32, 16, torch.float32, 3)
        torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids),
                                   experts_reference(x, w13, w2, weights, ids),
                                   rtol=1e-5, atol=1e-5)
    assert aligned == [(3, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,experts,top_k,renormalize", [
    (1, 128, 8, True), (9, 128, 8, False), (33, 6, 2, True), (4, 60, 4, False), (2, 8, 8, True)])
def test_fused_route_equals_route(t: int, experts: int, top_k: int, renormalize: bool,
                                  dtype: torch.dtype) -> None:
    """Softmax, top k (largest first), renormalized or not, in one launch: route's ids, and its
    weights to float32's rounding; experts not a power of two (6, 60), top k of all (8 of 8).
    bfloat16 logits tie now and then, and torch.topk orders equals as it likes (the kernel:
    the lowest id first), so there the picked experts' probabilities must be route's."""
    generator = torch.Generator().manual_seed(t * experts)
    logits = (torch.randn(t, experts, generator=generator) * 3).to(dtype).to(DEVICE)
    want_w, want_ids = route(logits, top_k, renormalize)
    got_w, got_ids = fused_route(logits, top_k, renormalize)
    assert got_ids.dtype == torch.int64 and got_w.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got_ids, want_ids)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        assert torch.equal(probs.gather(1, got_ids), probs.gather(1, want_ids))
        assert (got_ids.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct experts
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got_w.float(), want_w.float(), rtol=tol, atol=tol)
    # a router column of strided logits (a view of a wider tensor) reads the same
    wide = torch.cat([logits, logits], dim=1)[:, :experts]
    assert torch.equal(fused_route(wide, top_k, renormalize)[1], got_ids)
    with pytest.raises(ValueError, match=f"top_k must be in 1..{experts}"):
        fused_route(logits, experts + 1, renormalize)


@pytest.mark.parametrize("t,experts,top_k", [
    (1, 128, 8), (3, 128, 8), (64, 128, 8), (40, 6, 2), (300, 8, 3), (129, 60, 4)])
def test_the_alignment_kernel_equals_torch_s_stable_sort(t: int, experts: int, top_k: int
                                                         ) -> None:
    """One program's histogram, padded runs and stable ranks, and the same in a program per
    chunk of pairs: the torch ops' output exactly,
    over several chunks of pairs (300 x 3), experts not a power of two, experts with no pair
    (3 tokens of 128 experts), and routing skewed to a few experts (every run of one expert)."""
    generator = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(t)])
    skewed = ids % 3  # many pairs of experts 0-2: runs longer than a block
    for routing in (ids, skewed):
        routing = routing.to(DEVICE)
        for block_m in (16, 64):
            want = align_by_expert_reference(routing, experts, block_m)
            for mode in ("kernel", "chunks"):
                got = align_by_expert(routing, experts, block_m, mode)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), mode


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None
                ) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """Stacked experts quantized as a checkpoint stores them, each expert's gate, up and down
    projections on their own (quantize_fp8, per block or per output row), then laid out as
    FusedMoE holds them: w13's gate rows then up rows, the scales likewise."""
    inter = w13.shape[1] // 2

    def stack(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = [quantize_fp8(p, "block" if block else "channel", block or (128, 128))
                  for p in parts]
        return (torch.stack([w for w, _ in pieces]),
                torch.stack([s if block else s.reshape(-1) for _, s in pieces]))

    gate, gate_scale = stack(list(w13[:, :inter].float()))
    up, up_scale = stack(list(w13[:, inter:].float()))
    down, down_scale = stack(list(w2.float()))
    move = lambda v: v.to(DEVICE)  # noqa: E731
    scales = ExpertScales(move(torch.cat([gate_scale, up_scale], dim=1)), move(down_scale),
                          block)
    return move(torch.cat([gate, up], dim=1)), move(down), scales


@pytest.mark.parametrize("path", ["pairs", "grouped"])
@pytest.mark.parametrize("block", [None, (16, 16), (16, 32), (128, 128), (10, 16)])
@pytest.mark.parametrize("t,experts,top_k,hidden,inter", [
    (1, 4, 2, 48, 40), (5, 8, 2, 64, 42), (33, 8, 3, 48, 40)])
def test_fp8_experts_equal_the_dequantized_reference(
        t: int, experts: int, top_k: int, hidden: int, inter: int,
        block: tuple[int, int] | None, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """W8A16: FP8 weights with per-row or per-block scales, applied in the kernels, equal
    the product of x with the weights dequantized (fp8_experts_reference) in float32. K and N
    not multiples of 128 nor of the blocks (48, 40; 42: the gate/up parts end inside a block,
    and a pair kernel program's 4 rows straddle gate and up); blocks of 10 rows (a program's
    rows in two block rows); 128 x 128 blocks wider than the weights."""
    monkeypatch.setattr(triton_moe, "PAIR_KERNEL_MAX_PAIRS", 10**6 if path == "pairs" else 0)
    if path == "pairs" and t * top_k > 16:
        pytest.skip("the pair kernel is for few pairs (PAIR_KERNEL_MAX_PAIRS)")
    x, w13, w2, weights, ids = case(t, experts, top_k, hidden, inter, torch.float32, t + 1)
    w13, w2, scales = fp8_experts(w13.cpu(), w2.cpu(), block)
    assert w13.dtype == torch.float8_e4m3fn
    got = fused_experts(x, w13, w2, weights, ids, scales)
    want = fp8_experts_reference(x, w13, w2, weights, ids, scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the scales are applied: a scale of one expert doubled doubles its share
    expert = int(ids[0, 0])
    doubled = ExpertScales(scales.w13, scales.w2.clone(), block)
    doubled.w2[expert] *= 2
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, doubled),
                               fp8_experts_reference(x, w13, w2, weights, ids, doubled),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fused_experts(x, w13, w2, weights, ids, doubled), got)


@pytest.mark.parametrize("path", ["pairs", "grouped"])
@pytest.mark.parametrize("block", [None, (16, 16)])
def test_fp8_experts_in_bfloat16(block: tuple[int, int] | None, path: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 activations (the models' dtype): the FP8 tiles widen to bfloat16 exactly, so
    the product is the dequantized reference's to bfloat16's rounding of the weights and of
    the sum."""
    monkeypatch.setattr(triton_moe, "PAIR_KERNEL_MAX_PAIRS", 10**6 if path == "pairs" else 0)
    x, w13, w2, weights, ids = case(5, 8, 2, 64, 32, torch.bfloat16, 4)
    w13, w2, scales = fp8_experts(w13.cpu(), w2.cpu(), block)
    got = fused_experts(x, w13, w2, weights, ids, scales)
    want = fp8_experts_reference(x, w13, w2, weights, ids, scales)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)


def test_fp8_scales_that_do_not_fit_the_weights_are_errors() -> None:
    x, w13, w2, weights, ids = case(2, 4, 2, 48, 40, torch.float32, 0)
    fp8_w13, fp8_w2, scales = fp8_experts(w13.cpu(), w2.cpu(), (16, 16))
    short = ExpertScales(scales.w13[:, :5], scales.w2, (16, 16))
    with pytest.raises(ValueError, match=r"scales of shape \[4, 5, 3\] \(torch.float32\) do "
                                         r"not fit FP8 experts \[4, 80, 48\] per \(16, 16\): "
                                         r"\[4, 6, 3\] float32 expected"):
        fused_experts(x, fp8_w13, fp8_w2, weights, ids, short)
    with pytest.raises(ValueError, match="FP8 expert weights expected with scales, got "
                                         "torch.float32"):
        fused_experts(x, w13, w2, weights, ids, scales)


@pytest.mark.parametrize("tiles", [
    triton_moe.MoeTiles(32, triton_moe.GemmTiles(64, 32, 4, 3), triton_moe.GemmTiles(32, 16, 8, 4),
                        align="torch"),
    triton_moe.MoeTiles(64, triton_moe.GemmTiles(32, 16, 4, 4), triton_moe.GemmTiles(64, 64, 4, 3)),
    triton_moe.MoeTiles(16, triton_moe.GemmTiles(64, 32, 4, 3), triton_moe.GemmTiles(32, 16, 4, 3),
                        align="chunks"),
])
def test_tuned_tiles_give_the_reference_s_output(tiles: triton_moe.MoeTiles) -> None:
    """A tuned file's tiles (block_m, each GEMM's block_n / block_k, the alignment through
    torch's sort or the kernel) change the order of the sums, not their result."""
    x, w13, w2, weights, ids = case(40, 8, 3, 64, 48, torch.float32, 5)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, tiles=tiles),
                               experts_reference(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_a_tuned_file_gives_the_tiles_of_the_smallest_count_at_or_above_the_pairs(
        tmp_path: Path) -> None:
    key = triton_moe.moe_shape_key(128, 2048, 768, 8, torch.bfloat16)
    assert key == "E=128,H=2048,I=768,top_k=8,bfloat16"
    path = tmp_path / "GPU.json"
    path.write_text(json.dumps({"shapes": {key: {
        "512": {"block_m": 16, "gate_up": [64, 128, 4, 4], "down": [128, 64, 8, 3]},
        "64": {"block_m": 32, "gate_up": [64, 64, 4, 3], "down": [64, 64, 4, 3],
               "align": "torch"}}}}))
    buckets = triton_moe.load_tuned(path)[key]
    assert [count for count, _ in buckets] == [64, 512]
    assert triton_moe.tuned_tiles(buckets, 40).block_m == 32
    assert triton_moe.tuned_tiles(buckets, 64).align == "torch"
    assert triton_moe.tuned_tiles(buckets, 65).gate_up == triton_moe.GemmTiles(64, 128, 4, 4)
    assert triton_moe.tuned_tiles(buckets, 9999).down.block_n == 128  # past the last: the last
    assert triton_moe.load_tuned(tmp_path / "none.json") == {}


def test_a_bad_tuned_file_is_an_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        triton_moe.load_tuned(bad)
    entry = tmp_path / "entry.json"
    entry.write_text(json.dumps({"shapes": {"k": {"64": {"block_m": 16, "gate_up": [64]}}}}))
    with pytest.raises(ValueError, match=r"entry.json \[k\]\[64\].*block_m, gate_up and down"):
        triton_moe.load_tuned(entry)


def test_cpu_calls_and_fp8_experts_keep_the_heuristic_tiles() -> None:
    x, w13, w2, _, _ = case(40, 8, 3, 64, 48, torch.float32, 5)
    got = triton_moe.moe_tiles(x.cpu(), w13.cpu(), w2.cpu(), 3, None)
    assert got == triton_moe._heuristic_config(120, 8, 96, 64, 48, None)
    assert got.gate_up == triton_moe.GemmTiles(64, 64, 4, 3) and got.block_m == 16


@pytest.mark.parametrize(("block", "path"), [
    ("16-bit", "pairs"), ("16-bit", "kernel"), ("16-bit", "chunks"), ("16-bit", "torch"),
    (None, "pairs"), (None, "kernel"), ((16, 16), "pairs"), ((16, 16), "kernel")])
def test_expert_parallel_shares_through_the_kernels_sum_to_the_layer(
        block: tuple[int, int] | None | str, path: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert parallelism (FusedMoE.local_pairs, fused_experts' local_only): each of 2 ranks
    gets every pair, the other rank's as id -1 at weight 0; through the pair kernel (run by its
    expert 0, adding 0) or the grouped GEMM (each alignment; those pairs in blocks marked -1,
    skipped: only the rank's own experts' blocks run), the two shares, 16-bit or FP8, sum to
    the whole layer's product."""
    from sluice.distributed.tp import TPGroup
    from sluice.model.hf_config import MoeConfig
    from sluice.model.moe import FusedMoE

    monkeypatch.setattr(triton_moe, "PAIR_KERNEL_MAX_PAIRS", 10**6 if path == "pairs" else 0)
    t = 5 if path == "pairs" else 33
    x, w13, w2, weights, ids = case(t, 8, 2 if path == "pairs" else 3, 64, 32, torch.float32,
                                    t)
    assert (ids < 4).any() and (ids >= 4).any()  # both ranks' experts are routed to
    scales = None
    if block != "16-bit":
        w13, w2, scales = fp8_experts(w13.cpu(), w2.cpu(), block)
    want = (experts_reference(x, w13, w2, weights, ids) if scales is None
            else fp8_experts_reference(x, w13, w2, weights, ids, scales))
    tiles = None
    if path != "pairs":
        tiles = triton_moe.MoeTiles(16, triton_moe.GemmTiles(32, 16, 4, 3),
                                    triton_moe.GemmTiles(32, 16, 4, 3), align=path)
    blocks_run = []
    gemm = triton_moe._gemm
    monkeypatch.setattr(triton_moe, "_gemm", lambda *a, **kw: blocks_run.append(
        int((a[5] >= 0).sum())) or gemm(*a, **kw))
    moe = MoeConfig(num_experts=8, top_k=ids.shape[1], intermediate_size=32,
                    norm_topk_prob=True, dense_layers=())
    got = torch.zeros_like(want)
    for rank in range(2):
        share = FusedMoE(64, moe, TPGroup(rank=rank, size=2, expert_parallel=True)).to(DEVICE)
        local_weights, local_ids = share.local_pairs(weights, ids)
        mine = slice(4 * rank, 4 * rank + 4)
        assert torch.equal(local_ids >= 0, (ids >= 4 * rank) & (ids < 4 * rank + 4))
        assert (local_weights[local_ids < 0] == 0).all() and int(local_ids.max()) < 4
        rank_scales = None if scales is None else ExpertScales(
            scales.w13[mine], scales.w2[mine], scales.block)
        got += fused_experts(x, w13[mine], w2[mine], local_weights, local_ids, rank_scales,
                             tiles=tiles, local_only=True)
        if path != "pairs":
            counts = torch.bincount(local_ids[local_ids >= 0], minlength=4)
            assert blocks_run[-2:] == [int(((counts + 15) // 16).sum())] * 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_gpu_ops_of_an_expert_parallel_layer_take_its_other_ranks_pairs() -> None:
    """install_fused_ops gives a layer under expert parallelism fused_experts with local_only
    (its ids hold -1), so the layer on the GPU ops equals it on the reference ops."""
    from sluice.distributed.tp import TPGroup
    from sluice.model.hf_config import MoeConfig
    from sluice.model.moe import FusedMoE
    from sluice.worker.compile import install_fused_ops

    moe = MoeConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True,
                    dense_layers=())
    generator = torch.Generator().manual_seed(3)
    layer = FusedMoE(64, moe, TPGroup(rank=1, size=2, expert_parallel=True))
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    layer.to(DEVICE)
    x = torch.randn(7, 64, generator=generator).to(DEVICE)
    want = layer.rank_output(x)
    install_fused_ops(layer)
    assert layer.experts_op.keywords == {"local_only": True}
    torch.testing.assert_close(layer.rank_output(x), want, rtol=1e-5, atol=1e-5)
