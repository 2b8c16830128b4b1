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
that), while the copy to the host goes on and records the event the network put waits for. On
the CPU the cache reads and writes the host views directly, synchronously.
"""

from __future__ import annotations

from typing import Any

import torch


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
        self._device_staging: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        if self.cuda:
            self.load_stream = torch.cuda.Stream(device=self.device)
            self.save_stream = torch.cuda.Stream(device=self.device)

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    def _layer_views(self, buffer: torch.Tensor, num_slots: int) -> list[torch.Tensor]:
        """Per layer, [num_slots, 2, block_size, heads, dim] views of `buffer`'s slots."""
        typed = buffer.view(self.dtype)
        slot = self.stride // typed.element_size()
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

    def finish_saves(self, slot_runs: list[tuple[int, int]]) -> Any:
        """After the step's last save_layer: the compute stream waits for the gathers (the
        blocks may be reused after them); the copies to the host slots go on. Returns the event
        that the host copies are done (None on the CPU: done already)."""
        if not self.cuda:
            return None
        with torch.cuda.stream(self.save_stream):
            gathered = torch.cuda.Event()
            gathered.record()
            buffer, _ = self._staging("save", sum(length for _, length in slot_runs))
            offset = 0
            for slot, length in slot_runs:
                self.host[slot * self.stride:(slot + length) * self.stride].copy_(
                    buffer[offset * self.stride:(offset + length) * self.stride],
                    non_blocking=True)
                offset += length
            copied = torch.cuda.Event()
            copied.record()
        torch.cuda.current_stream().wait_event(gathered)
        return copied

    def release(self) -> None:
        """Drop the staging memory (the pinned host buffer is given back to the system)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._device_staging = {}
        self.host_views = []
        self.host = torch.empty(0, dtype=torch.uint8)
        self.kv_caches = {}
        if self.cuda and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # the caching host allocator keeps freed pinned memory
