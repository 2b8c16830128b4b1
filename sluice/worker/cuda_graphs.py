"""CUDA graphs of the whole model forward: decode batches, and lone prompts.

A decode batch of B requests is one query token each. It is padded to the next captured size
(see capture_sizes): padding rows store nothing (slot -1), have no context
(seq_len 0) and read the null block. Each graph was captured on the runner's persistent device
buffers, so replaying it only needs this step's inputs copied into those buffers first. Sampling
stays outside the graph: which rows sample, and how, changes every step.

The same class holds the graphs of one-prompt prefills, keyed by padded token count: the
tokens past the prompt store nothing and come out as zeros; and those of any other step (several
prompts, prompts beside decodes), keyed by padded token count with the requests padded to a fixed
number: a padding request has no queries and no context.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from sluice.attention.metadata import AttentionMetadata

# (input_ids, positions, metadata) -> hidden [T, hidden]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then steps of 8 to 64, of 16 to 128 and of 32 beyond: a batch is padded by at
    most 7 rows or a quarter of its size."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 129, 16), *range(160, max_size + 1, 32)]
    sizes = [s for s in sizes if s <= max_size]
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


class DecodeGraphs:
    def __init__(self, sizes: list[int], pool: object = None) -> None:
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool  # share another set's memory pool: only one graph runs at a time
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num: int) -> int | None:
        """The captured size to run `num` requests (or tokens) with, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(self, forward: ForwardFn,
                make_inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor,
                                                   AttentionMetadata]]) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        for size in reversed(self.sizes):
            input_ids, positions, metadata = make_inputs(size)
            forward(input_ids, positions, metadata)  # warm up (compiles kernels)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = forward(input_ids, positions, metadata)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on whatever the persistent buffers hold: hidden [size, H]."""
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size]
