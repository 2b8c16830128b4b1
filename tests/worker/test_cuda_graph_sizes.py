"""Decode batches are padded to a captured CUDA-graph size; every size up to the largest fits."""

from __future__ import annotations

from sluice.worker.cuda_graphs import DecodeGraphs, capture_sizes


def test_capture_sizes_cover_every_batch_with_bounded_padding() -> None:
    for max_size in (1, 6, 100, 256, 512):
        sizes = capture_sizes(max_size)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_size
        graphs = DecodeGraphs(sizes)
        for num_reqs in range(1, max_size + 1):
            padded = graphs.padded_size(num_reqs)
            assert padded is not None and padded >= num_reqs
            assert padded - num_reqs <= max(7, num_reqs // 4)
        assert graphs.padded_size(max_size + 1) is None
