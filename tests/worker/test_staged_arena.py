"""StagedArena: a step's input buffers share one pinned host allocation and one device
allocation at the same offsets, so neighbouring buffers travel in one copy."""

from __future__ import annotations

import pytest
import torch

from sluice.worker.input_batch import StagedArena

SPECS = {
    "a": ((5,), torch.int32),
    "b": ((3,), torch.int64),
    "c": ((7,), torch.int32),
}


def make_arena(device: str) -> StagedArena:
    return StagedArena(SPECS, torch.device(device))


def test_buffers_are_disjoint_aligned_views_of_one_allocation():
    arena = make_arena("cpu")
    a, b, c = (arena.buffers[n] for n in "abc")
    assert [buf.cpu.shape[0] for buf in (a, b, c)] == [5, 3, 7]
    assert [buf.cpu.dtype for buf in (a, b, c)] == [torch.int32, torch.int64, torch.int32]
    offsets = [arena.offsets[id(buf)] for buf in (a, b, c)]
    assert offsets == [0, 64, 128] and all(o % StagedArena.ALIGN == 0 for o in offsets)
    a.np[:] = -1
    b.np[:] = 2**40
    c.np[:] = 7
    assert a.np.tolist() == [-1] * 5 and b.np.tolist() == [2**40] * 3 and c.np.tolist() == [7] * 7
    assert c.cpu.data_ptr() == arena.cpu.data_ptr() + 128
    # On the CPU the device twin is the host buffer itself.
    assert a.device is a.cpu
    assert arena.span_bytes(a, c, 2) == 128 + 2 * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_copy_span_uploads_whole_buffers_between_and_a_prefix_of_the_last():
    arena = make_arena("cuda")
    a, b, c = (arena.buffers[n] for n in "abc")
    a.np[:] = [1, 2, 3, 4, 5]
    b.np[:] = [10, 20, 30]
    c.np[:] = range(100, 107)
    arena.copy_span(a, c, 3)
    torch.cuda.synchronize()
    assert a.device.tolist() == [1, 2, 3, 4, 5] and b.device.tolist() == [10, 20, 30]
    assert c.device.tolist() == [100, 101, 102, 0, 0, 0, 0]
    c.np[:] = 0
    arena.copy_span(b, c, 7)  # from a later buffer: a is left as it is
    a.np[:] = 0
    torch.cuda.synchronize()
    assert a.device.tolist() == [1, 2, 3, 4, 5] and c.device.tolist() == [0] * 7
