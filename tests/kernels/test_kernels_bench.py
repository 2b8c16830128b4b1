"""The attention-kernel benchmark's inputs and byte counts (the benchmark itself needs a GPU):
an 8-bit case's cache holds the quantized values, and its bytes count one byte a cached value
and two a query or output value; its fused decode case's two paths compute the same thing.
Here, not in tests/bench: the benchmark imports the kernels, which must first be imported after
this directory's conftest has chosen the interpreter."""

from __future__ import annotations

import pytest
import torch

from sluice.attention.kv_layout import to_cache_dtype
from sluice.attention.triton_backend import TritonBackend
from sluice.bench.kernels import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    decode_bytes,
    main,
    make_fused_step,
    make_step,
    run_fused,
)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=str)
def test_a_decode_step_over_each_cache_dtype(cache_dtype):
    cpu = torch.device("cpu")
    _, _, _, kv_cache, metadata = make_step([100, 50], [1, 1], cpu, cache_dtype=cache_dtype)
    _, _, _, bf16_cache, _ = make_step([100, 50], [1, 1], cpu)
    assert kv_cache.dtype == cache_dtype
    assert torch.equal(kv_cache.view(torch.uint8), to_cache_dtype(bf16_cache, cache_dtype)
                       .view(torch.uint8))
    assert metadata.seq_lens_cpu.tolist() == [100, 50]
    kv_bytes = 2 * 150 * NUM_KV_HEADS * HEAD_DIM * cache_dtype.itemsize
    assert decode_bytes([100, 50], kv_cache) == kv_bytes + 2 * 2 * NUM_HEADS * HEAD_DIM * 2


def test_an_unknown_cache_dtype_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        main(["--output", "/dev/null", "--kv-cache-dtype", "int4"])
    assert "'int4'" in capsys.readouterr().err


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_the_fused_decode_case_computes_what_its_two_launches_do(cache_dtype):
    """The fused case's one launch and the two it replaces, on the benchmark's inputs: the same
    outputs (but for float32 summation order) and the same K/V bytes stored in the cache."""
    cpu = torch.device("cpu")
    step = make_fused_step(2, 40, cpu, cache_dtype)
    fused_step = make_fused_step(2, 40, cpu, cache_dtype)
    two = step.two_launches(TritonBackend(), step.qkv.clone())
    tiles = TritonBackend().decode_plan(2, NUM_KV_HEADS, 40, cpu, cache_dtype)[1]
    fused = fused_step.fused(tiles)
    assert fused.shape == two.shape == (2, NUM_HEADS * HEAD_DIM)
    torch.testing.assert_close(fused.float(), two.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(fused_step.kv_cache.view(torch.uint8), step.kv_cache.view(torch.uint8))


@pytest.mark.parametrize("flag", ["--fused-cases", "--decode-cases"])
@pytest.mark.parametrize("bad", ["64", "0x192", "64x", "ax192"])
def test_a_malformed_case_is_refused_by_name(flag, bad):
    with pytest.raises(ValueError, match=repr(bad)):
        main(["--output", "/dev/null", flag, bad])


class _CallTwice:
    """Stands in for GraphTimer where no GPU is (its CUDA graphs and events need one): runs
    the function as the timer's warm-up and capture would, and reports a fixed time."""

    def __init__(self) -> None:
        self.flush = torch.empty(1)

    def __call__(self, fn) -> float:
        fn()
        fn()
        return 1e-5


def test_the_fused_decode_case_reports_each_path_against_the_two_launches():
    tiles = {"fused": TritonBackend().decode_plan(2, NUM_KV_HEADS, 40, torch.device("cpu"),
                                                  torch.bfloat16)[1]}
    record = run_fused(_CallTwice(), 1e12, 2, 40, tiles)
    assert record["batch"] == 2 and record["context"] == 40
    assert set(record["runs"]) == {"two_launches", "fused"}
    for run in record["runs"].values():
        assert run["us"] == 10.0 and run["bytes_per_s"] == record["bytes"] / 1e-5
        assert run["max_abs_diff_vs_two_launches"] < 2e-2
    assert record["runs"]["two_launches"]["max_abs_diff_vs_two_launches"] == 0.0
