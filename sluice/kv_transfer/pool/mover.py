"""Moves KV blocks between the paged cache and the pool connector's host staging buffer.

The host staging buffer (pinned where CUDA is present; registered with the backend) is
`num_slots` slots of `stride` bytes. Slot s holds one pool value at byte s * stride: this rank's
KV of one block over every layer, [num_layers, 2, block_size, heads, dim], then the backend's
trailer. A layer's view of the slots is therefore strided (one slot apart).

Why not the CPU tier's BlockMover (offloading.py): its host store is one tensor per layer, while a
pool value must be one block of all layers, contiguous (one key per block). A DMA copy cannot
read a strided host view, so on CUDA every move goes through a device staging buffer laid out like
the host slots: one contiguous copy per run of slots, and one scatter (load) or gather (save)
kernel per layer. Loads run on a load stream; each layer's scatter records an event that the
layer's attention waits for. Saves gather each layer on a save stream after the compute stream
stored it; the compute stream then waits only for the gathers (the blocks may be reused after
that), while a copy thread copies them to the host in 8 MiB pieces, one at a time (a step's
own small D2H copies would queue behind one whole copy: `copy_saves`), then puts them. On
the CPU the cache reads and writes the host views directly, synchronously.

Direct loads from the shm arena (`arena_views`, `load_direct`; the worker's default for `shm`)
skip the host staging buffer: the arena's mapping is viewed per layer like the slots (slot
stride = the server's slot size). On the CPU each layer's values are gathered from the arena
straight into the cache blocks. On CUDA the mapping is registered with the driver once
(cudaHostRegister, undone by a hook before the mapping closes) and each value is one
non-blocking H2D copy (torch._foreach_copy_) from its arena slot into its device staging slot
on the load stream, then the same scatter per layer; the event after the copies says when the
arena is no longer read (the load thread waits for it before unpinning).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

logger = logging.getLogger("sluice")
# Saves' device-to-host copies go in pieces of this size, one at a time (copy_saves).
PACE_BYTES = 8 << 20


class StagingMover:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_slots: int, stride: int) -> None:
        first = next(iter(kv_caches.values()))
        self.kv_caches = dict(kv_caches)  # {layer: [2, num_blocks, block_size, heads, dim]}
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.block_shape = tuple(first.shape[2:])  # (block_size, heads, dim)
        self.dtype = first.dtype
        self.device = first.device
        self.cuda = first.is_cuda
        self.num_slots = num_slots
        self.stride = stride
        if stride % first.element_size():
            raise ValueError(f"slot stride {stride} is not a multiple of the {self.dtype} size")
        self.host = torch.empty(num_slots * stride, dtype=torch.uint8, pin_memory=self.cuda)
        self.host_views = self._layer_views(self.host, num_slots)
        self._host_registered = 0  # the address of adopted host memory registered with CUDA
        self._device_staging: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._arena_views: dict[int, list[torch.Tensor]] = {}  # by the mapping's address
        self._arena_memory: dict[int, tuple[torch.Tensor, int, int]] = {}  # by id(views)
        # One value's payload: every layer's K and V of one block.
        self.payload_bytes = len(kv_caches) * 2 * first[0, 0].numel() * first.element_size()
        if self.cuda:
            self.load_stream = torch.cuda.Stream(device=self.device)
            self.save_stream = torch.cuda.Stream(device=self.device)

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    def use_host_memory(self, address: int) -> bool:
        """Stage in the `nbytes` bytes at `address` (memory a backend moves values from and to
        without a copy, mapped for the process's life: `PoolBackend.host_memory`) instead of
        the buffer allocated here; before any move. On CUDA the memory is registered with the
        driver first (cudaHostRegister, as the shm arena is; undone by `release`). False where
        it cannot be: the buffer allocated here stays."""
        nbytes = self.nbytes
        if self.cuda:
            cudart = torch.cuda.cudart()
            with torch.cuda.device(self.device):
                code = cudart.cudaHostRegister(address, nbytes, 0)
            if int(code) != 0:
                logger.warning("KV pool: the backend's shared staging memory (%d bytes) cannot "
                               "be registered with CUDA (error %s): staging stays in pinned "
                               "memory of its own", nbytes, code)
                return False
            self._host_registered = address
        self.host = torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(address),
                                     dtype=torch.uint8)
        self.host_views = self._layer_views(self.host, self.num_slots)
        if self.cuda and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # give the pinned buffer allocated here back
        return True

    def _layer_views(self, buffer: torch.Tensor, num_slots: int,
                     stride: int | None = None) -> list[torch.Tensor]:
        """Per layer, [num_slots, 2, block_size, heads, dim] views of `buffer`'s slots (of
        `stride` bytes, the staging stride by default)."""
        typed = buffer.view(self.dtype)
        slot = (stride or self.stride) // typed.element_size()
        block_size, heads, dim = self.block_shape
        per_kv = block_size * heads * dim
        strides = (slot, per_kv, heads * dim, dim, 1)
        shape = (num_slots, 2, block_size, heads, dim)
        return [typed.as_strided(shape, strides, typed.storage_offset() + layer * 2 * per_kv)
                for layer in range(len(self.kv_caches))]

    def _staging(self, name: str, num_slots: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A device buffer of `num_slots` slots laid out like the host's, grown as needed."""
        staging = self._device_staging.get(name)
        if staging is None or staging[0].numel() < num_slots * self.stride:
            buffer = torch.empty(num_slots * self.stride, dtype=torch.uint8, device=self.device)
            staging = (buffer, self._layer_views(buffer, num_slots))
            self._device_staging[name] = staging
        return staging

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self.cuda:
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        return ids

    # ---- loads (from the load thread) ----

    def compute_marker(self) -> Any:
        """An event on the compute stream now: loads of this step come after everything queued
        before it (an earlier step that used the blocks). None on the CPU."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def load(self, first_slot: int, num_slots: int, picks: list[int], block_ids: list[int],
             after: Any) -> dict[str, Any]:
        """Write the values in slots first_slot + picks[i] into cache blocks block_ids[i], every
        layer; returns {layer: event} on CUDA (empty on the CPU: done on return)."""
        if not picks:
            return {}
        rows = None if picks == list(range(num_slots)) else torch.tensor(picks)
        if not self.cuda:
            ids = torch.tensor(block_ids, dtype=torch.int64)
            for name, kv in self.kv_caches.items():
                src = self.host_views[self.layer_index[name]][first_slot:first_slot + num_slots]
                if rows is not None:
                    src = src.index_select(0, rows)
                kv.transpose(0, 1).index_copy_(0, ids, src)
            return {}
        events = {}
        # (On the load thread: its current device is not the engine's unless set.)
        with torch.cuda.device(self.device), torch.cuda.stream(self.load_stream):
            self.load_stream.wait_event(after)
            buffer, views = self._staging("load", num_slots)
            start = first_slot * self.stride
            buffer[:num_slots * self.stride].copy_(
                self.host[start:start + num_slots * self.stride], non_blocking=True)
            ids = self._ids(block_ids)
            if rows is not None:
                rows = rows.pin_memory().to(self.device, non_blocking=True)
            for name, kv in self.kv_caches.items():
                src = views[self.layer_index[name]][:num_slots]
                if rows is not None:
                    src = src.index_select(0, rows)
                kv.transpose(0, 1).index_copy_(0, ids, src)
                event = torch.cuda.Event()
                event.record()
                events[name] = event
        return events

    # ---- direct loads: straight from the shm arena's mapping (from the load thread) ----

    def arena_views(self, arena: Any) -> list[torch.Tensor] | None:
        """Per layer, [arena slots, 2, block_size, heads, dim] views of the shm arena's mapping
        (`arena`: shm_store's _Arena), made once per mapping; on CUDA the mapping is registered
        with the driver first (cudaHostRegister: DMA reads it; undone before the mapping
        closes). None where it cannot be: the caller loads through the staging buffer."""
        views = self._arena_views.get(arena.address)
        if views is not None:
            return views
        if arena.slot_bytes % self.kv_caches[next(iter(self.kv_caches))].element_size():
            return None
        if self.cuda:
            cudart = torch.cuda.cudart()
            with torch.cuda.device(self.device):
                code = cudart.cudaHostRegister(arena.address, arena.nbytes, 0)
            if int(code) != 0:
                logger.warning("KV pool: the shm arena (%d bytes) cannot be registered with "
                               "CUDA (error %s): loads go through the staging buffer",
                               arena.nbytes, code)
                return None

            def unregister(address: int = arena.address) -> None:
                self._arena_memory.pop(id(self._arena_views.pop(address, None)), None)
                cudart.cudaHostUnregister(address)
        else:
            def unregister(address: int = arena.address) -> None:
                self._arena_memory.pop(id(self._arena_views.pop(address, None)), None)
        memory = torch.frombuffer((ctypes.c_ubyte * arena.nbytes).from_address(arena.address),
                                  dtype=torch.uint8)
        views = self._layer_views(memory, arena.nbytes // arena.slot_bytes, arena.slot_bytes)
        self._arena_views[arena.address] = views
        self._arena_memory[id(views)] = (memory, self.payload_bytes, arena.slot_bytes)
        arena.on_close(unregister)
        return views

    def load_direct(self, views: list[torch.Tensor], slots: list[int], block_ids: list[int],
                    after: Any) -> tuple[dict[str, Any], Any]:
        """Write the values in arena slots `slots` (`views` from `arena_views`) into cache
        blocks `block_ids`, every layer. On the CPU: copied now, ({}, None). On CUDA: one
        non-blocking H2D copy per value from the arena into the device staging buffer, then one
        scatter per layer, on the load stream; returns ({layer: event}, the event after which
        the arena is no longer read)."""
        if not slots:
            return {}, None
        if not self.cuda:
            ids = torch.tensor(block_ids, dtype=torch.int64)
            rows = torch.tensor(slots, dtype=torch.int64)
            for name, kv in self.kv_caches.items():
                kv.transpose(0, 1).index_copy_(
                    0, ids, views[self.layer_index[name]].index_select(0, rows))
            return {}, None
        events = {}
        num = len(slots)
        with torch.cuda.device(self.device), torch.cuda.stream(self.load_stream):
            self.load_stream.wait_event(after)
            buffer, staged = self._staging("load", num)
            memory, size, slot_bytes = self._arena_memory[id(views)]
            # Each value's layers are contiguous: one copy per value, of its whole payload.
            torch._foreach_copy_(
                [buffer[i * self.stride:i * self.stride + size] for i in range(num)],
                [memory[slot * slot_bytes:slot * slot_bytes + size] for slot in slots],
                non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            ids = self._ids(block_ids)
            for name, kv in self.kv_caches.items():
                kv.transpose(0, 1).index_copy_(0, ids, staged[self.layer_index[name]][:num])
                event = torch.cuda.Event()
                event.record()
                events[name] = event
        return events, copied

    def host_free_event(self) -> Any:
        """(CUDA) An event after every host read queued on the load stream so far."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.load_stream)
        return event

    def wait(self, event: Any) -> None:
        """Order the compute stream after `event`."""
        torch.cuda.current_stream().wait_event(event)

    # ---- saves (from the step) ----

    def save_layer(self, layer_name: str, kv: torch.Tensor, block_ids: Any,
                   slot_runs: list[tuple[int, int]]) -> None:
        """Copy blocks `block_ids` (from `save_ids`) of layer `layer_name` toward the host slots
        of `slot_runs` ((first slot, length), in block order)."""
        layer = self.layer_index[layer_name]
        if not self.cuda:
            offset = 0
            for slot, length in slot_runs:
                self.host_views[layer][slot:slot + length].copy_(
                    kv.transpose(0, 1).index_select(0, block_ids[offset:offset + length]))
                offset += length
            return
        num = block_ids.shape[0]
        # After the layer's KV of this step is stored on the compute stream.
        self.save_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.save_stream):
            _, views = self._staging("save", num)
            views[layer][:num].copy_(kv.transpose(0, 1).index_select(0, block_ids))

    def save_ids(self, block_ids: list[int]) -> torch.Tensor:
        return self._ids(block_ids)

    def finish_saves(self) -> Any:
        """After the step's last save_layer: the compute stream waits for the gathers (the
        blocks may be reused after them). Returns the gathers' event for `copy_saves` (None on
        the CPU: the host slots are written already)."""
        if not self.cuda:
            return None
        gathered = torch.cuda.Event()
        gathered.record(self.save_stream)
        torch.cuda.current_stream().wait_event(gathered)
        return gathered

    def copy_saves(self, slot_runs: list[tuple[int, int]], gathered: Any) -> None:
        """(The worker's copy thread, CUDA) Copy the gathered blocks to the host slots of
        `slot_runs`, in pieces of PACE_BYTES, each queued once the one before it ended. A
        copy engine serves the copies of one direction in order, so a step's own small D2H
        copy (its sampled tokens) queued behind a whole copy of one 4k-token prompt of an 8B
        model (576 MiB) waited 8.8 ms on the H200, and 0.16 ms behind paced pieces (whose
        copy runs at 47 against 55 GB/s; benchmarks/tools/dma_interleave.py). Returns once
        the last piece is in the host slots. Call it before the next step's save_layer (the
        gathers reuse the device staging buffer)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.save_stream):
            self.save_stream.wait_event(gathered)
            buffer, _ = self._staging("save", sum(length for _, length in slot_runs))
            offset = 0
            for slot, length in slot_runs:
                start, size = slot * self.stride, length * self.stride
                for piece in range(0, size, PACE_BYTES):
                    end = min(size, piece + PACE_BYTES)
                    self.host[start + piece:start + end].copy_(
                        buffer[offset + piece:offset + end], non_blocking=True)
                    self.save_stream.synchronize()
                offset += size

    def release(self) -> None:
        """Drop the staging memory (the pinned host buffer is given back to the system)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._device_staging = {}
        self.host_views = []
        self.host = torch.empty(0, dtype=torch.uint8)
        if self._host_registered:
            torch.cuda.cudart().cudaHostUnregister(self._host_registered)
            self._host_registered = 0
        self.kv_caches = {}
        if self.cuda and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # the caching host allocator keeps freed pinned memory
