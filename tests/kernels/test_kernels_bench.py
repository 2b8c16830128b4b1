"""The attention-kernel benchmark's inputs and byte counts (the benchmark itself needs a GPU):
an 8-bit case's cache holds the quantized values, and its bytes count one byte a cached value
and two a query or output value. Here, not in tests/bench: the benchmark imports the kernels,
which must first be imported after this directory's conftest has chosen the interpreter."""

from __future__ import annotations

import pytest
import torch

from sluice.attention.kv_layout import to_cache_dtype
from sluice.bench.kernels import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, decode_bytes, main, make_step


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
