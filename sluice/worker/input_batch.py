"""Per-request state kept by the model runner, and the persistent input buffers of one step.

Block tables live in one host array with a row per request (a row is taken when the runner first
sees the request and released when it finishes), updated incrementally as blocks are added. Each
step gathers the scheduled rows with one fancy index. Inputs are written into pinned host buffers
and copied to the device without blocking, into device buffers that never move, which is also what
CUDA graphs replay from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sluice.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    row: int  # this request's row in BlockTables
    num_computed_tokens: int
    # Prompt logprob entries already sent (entry 0 is None); recompute after preemption
    # must not send them twice.
    num_prompt_logprobs_sent: int = 0
    # The launched step whose sampled token for this request is still on the device (async
    # scheduling), and the token's row in that step's samples.
    pending_step: object | None = None
    pending_index: int = -1
    # Device n-gram drafts (sluice/spec_decode/device_ngram.py): the launched step whose
    # tokens for this request are all the device history lacks; None: not known to be current.
    history_step: object | None = None
    # Sampling launches that included this request (counted at launch, so a token still in
    # flight counts): with a seed, it keys the request's draws (sampling_inputs.build_row_seeds).
    num_sampled: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class BlockTables:
    """Host block tables, one row per live request: [rows, max_blocks_per_req] int32; a hybrid
    model's KV cache groups have one each, side by side in `tables` [groups, rows, max_blocks]
    (`table` is group 0's), every group's row as long as the others."""

    def __init__(self, max_blocks_per_req: int, initial_rows: int = 64,
                 num_groups: int = 1) -> None:
        self.max_blocks_per_req = max_blocks_per_req
        self.tables = np.zeros((num_groups, initial_rows, max_blocks_per_req), dtype=np.int32)
        self.table = self.tables[0]
        self.num_blocks = np.zeros(initial_rows, dtype=np.int32)
        self.free_rows = list(range(initial_rows - 1, -1, -1))

    def add_row(self) -> int:
        if not self.free_rows:
            old = self.table.shape[0]
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)], axis=1)
            self.table = self.tables[0]
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self.free_rows.pop()
        self.num_blocks[row] = 0
        return row

    def release_row(self, row: int) -> None:
        self.free_rows.append(row)

    def append(self, row: int, block_ids: list[int],
               group_block_ids: list[list[int]] = ()) -> None:
        """Add group 0's `block_ids` to the row, and groups 1..'s (as many each)."""
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(f"a request needs {end} blocks, more than max_model_len allows "
                             f"({self.max_blocks_per_req})")
        self.table[row, start:end] = block_ids
        for group, ids in enumerate(group_block_ids, start=1):
            assert len(ids) == len(block_ids), (group, len(ids), len(block_ids))
            self.tables[group, row, start:end] = ids
        self.num_blocks[row] = end

    def replace(self, row: int, block_ids: list[int],
                group_block_ids: list[list[int]] = ()) -> None:
        self.num_blocks[row] = 0
        self.append(row, block_ids, group_block_ids)


class StagedBuffer:
    """A host buffer (pinned when the device is a GPU) with a numpy view, and its device twin."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 views: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """views: (host, device) tensors to use rather than new ones (a StagedArena's)."""
        if views is not None:
            self.cpu, self.device = views
        else:
            pin = device.type == "cuda"
            self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.device = self.cpu if device.type == "cpu" else torch.zeros(
                shape, dtype=dtype, device=device)
        self.np = self.cpu.numpy()

    def to_device(self, n: int) -> torch.Tensor:
        """Copy the first n entries to the device (contiguous, so the copy never goes through
        pageable memory and never blocks the host); returns that device view."""
        src, dst = self.cpu[:n], self.device[:n]
        if dst is not src:
            dst.copy_(src, non_blocking=True)
        return dst


class StagedArena:
    """StagedBuffers laid end to end at the same byte offsets in one pinned host allocation and
    one device allocation, so that neighbours travel in one copy (`copy_span`). A step's
    inputs used to go in eight small copies; on an H200 each cost 3 to 7 us of the device's time
    between two decode steps (a copy, then the gap to the next)."""

    ALIGN = 64

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device) -> None:
        self.offsets: dict[int, int] = {}  # id(buffer) -> byte offset
        layout = []
        total = 0
        for name, (shape, dtype) in specs.items():
            nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
            layout.append((name, shape, dtype, total, nbytes))
            total += -(-nbytes // self.ALIGN) * self.ALIGN
        self.cpu = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device = self.cpu if device.type == "cpu" else torch.zeros(
            total, dtype=torch.uint8, device=device)
        self.buffers: dict[str, StagedBuffer] = {}
        for name, shape, dtype, offset, nbytes in layout:
            host = self.cpu[offset:offset + nbytes].view(dtype).view(shape)
            twin = host if self.device is self.cpu else self.device[
                offset:offset + nbytes].view(dtype).view(shape)
            buffer = StagedBuffer(shape, dtype, device, views=(host, twin))
            self.buffers[name] = buffer
            self.offsets[id(buffer)] = offset

    def copy_span(self, first: StagedBuffer, last: StagedBuffer, last_count: int) -> None:
        """Copy everything from `first`'s start to `last`'s first `last_count` entries (whole
        buffers in between, used or not) to the device, without blocking."""
        if self.device is self.cpu:
            return
        start = self.offsets[id(first)]
        end = self.offsets[id(last)] + last_count * last.cpu.element_size()
        if end > start:
            self.device[start:end].copy_(self.cpu[start:end], non_blocking=True)

    def span_bytes(self, first: StagedBuffer, last: StagedBuffer, last_count: int) -> int:
        return (self.offsets[id(last)] + last_count * last.cpu.element_size()
                - self.offsets[id(first)])
