"""A CPU tier under the paged KV cache (vLLM's `OffloadingConnector` name and config).

The full blocks of every request are saved, asynchronously and layer by layer, into a bounded
store in host memory (pinned where CUDA is present) when the request lets them go; a request
whose prefix misses the GPU prefix cache but is in the CPU tier loads those blocks instead of
recomputing them. The prefix cache thus outgrows GPU memory.

    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": N}}
    (or the shorthand kv_offloading_size=GiB / --kv-offloading-size GIB)

When to save. A block only leaves the GPU prefix cache after its last request frees it, so
saving at that moment loses nothing against saving as blocks fill, and it is one batched move
per finished request rather than a move every step: saving each block as it filled (after every
layer of every step, through the CUDA graphs' per-layer events) cost 23% of the offline
throughput on an H100, nearly all of it host work and launches per step
(benchmarks/journal/2026-11-23-step-boundary-and-cpu-kv-tier.md). So `request_finished` plans
the save of the request's full blocks the tier lacks and delays the free (`delay_free`); the next
step moves them (at its start, off the compute stream) and the worker reports the request in
`finished_sending` once the copies are done; only then are the blocks freed and the slots
loadable. Blocks of a preempted request
are freed without a save (they stay in the GPU cache until evicted): a known gap.

Scheduler half: the index of the tier. Slots of one block each (every layer), keyed by the
block's chained hash within this instance's namespace (model, dtype, block size, layout, rank),
LRU-evicted; a slot is pinned while a load reads it or a save fills it. Lookups walk the
request's block hashes after the local hit and stop at the first miss.

Worker half: the store, one tensor per layer ([num_slots, 2, block_size, heads, dim]: a slot's
K and V in one chunk), moved by a BlockMover (a copy per run of consecutive slots through a
device staging buffer, and one scatter / gather kernel per layer, wherever the GPU blocks are).
Loads of all layers are issued at the start of the step on a side stream, one event per layer;
each attention layer waits only for its own (in a CUDA graph too: sluice/worker/layer_events.py).
Saves run on another side stream after the compute stream's work so far; the blocks stay held
until they are done. On the CPU everything is synchronous.

The CPU tier never fails a load (host memory), so it reports no invalid blocks.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from sluice.config import KVTransferConfig
from sluice.core.kv_connector import KVCacheSpec, KVConnectorScheduler, SchedulerView
from sluice.core.outputs import KVConnectorOutput, SchedulerOutput
from sluice.worker.kv_connector import KVConnectorWorker

if TYPE_CHECKING:
    import torch

    from sluice.core.request import Request

logger = logging.getLogger("sluice")

_EXTRA_KEYS = ("cpu_bytes_to_use",)


class OffloadingMetadata(msgspec.Struct):
    """One step's copies: GPU block load_gpu_blocks[i] <- CPU slot load_cpu_slots[i]; per
    finished request, its CPU slots <- its GPU blocks (reported in finished_sending when done)."""

    load_gpu_blocks: list[int] = msgspec.field(default_factory=list)
    load_cpu_slots: list[int] = msgspec.field(default_factory=list)
    saves: dict[str, tuple[list[int], list[int]]] = msgspec.field(default_factory=dict)


def num_cpu_slots(config: KVTransferConfig, spec: KVCacheSpec) -> int:
    extra = config.kv_connector_extra_config
    unknown = sorted(set(extra) - set(_EXTRA_KEYS))
    if unknown:
        raise ValueError(f"OffloadingConnector: unknown kv_connector_extra_config keys "
                         f"{unknown}; allowed: {list(_EXTRA_KEYS)}")
    size = extra.get("cpu_bytes_to_use")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"OffloadingConnector: kv_connector_extra_config.cpu_bytes_to_use "
                         f"must be an integer number of bytes > 0, got {size!r}")
    slots = size // spec.bytes_per_block
    if slots < 1:
        raise ValueError(f"OffloadingConnector: cpu_bytes_to_use ({size}) is less than one "
                         f"KV block ({spec.bytes_per_block} bytes over {spec.num_layers} "
                         "layers)")
    return slots


def namespace(spec: KVCacheSpec) -> bytes:
    """8 bytes naming what a block hash means here: the same tokens under another model,
    dtype, block size, layout or rank are other bytes."""
    text = (f"{spec.model}@{spec.dtype}@bs{spec.block_size}@{spec.layout}"
            f"@tp{spec.tp_rank}/{spec.tp_size}")
    return hashlib.sha256(text.encode()).digest()[:8]


@dataclass(slots=True)
class _Slot:
    slot_id: int
    ready: bool = False  # its save has completed
    pins: int = 0  # loads in flight reading it, or its save in flight


class OffloadingConnectorScheduler(KVConnectorScheduler):
    metadata_type = OffloadingMetadata

    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        super().__init__(config, kv_cache_spec)
        self.num_slots = num_cpu_slots(config, kv_cache_spec)
        self._namespace = namespace(kv_cache_spec)
        self._index: OrderedDict[bytes, _Slot] = OrderedDict()  # LRU first
        self._free_slots = deque(range(self.num_slots))
        # Loads planned by update_state_after_alloc, sent with the next plan: (gpu, key).
        self._pending_loads: list[tuple[int, bytes]] = []
        # Keys each step in flight loads from (unpinned when its report comes back).
        self._loads_in_flight: deque[list[bytes]] = deque()
        # Saves planned by request_finished, sent with the next plan; then in flight until the
        # worker reports the request in finished_sending.
        self._pending_saves: dict[str, tuple[list[int], list[int]]] = {}
        self._saves_in_flight: dict[str, list[bytes]] = {}
        self._stats = {"lookups": 0, "hit_blocks": 0, "loaded_blocks": 0, "saved_blocks": 0,
                       "evicted_blocks": 0}

    def _key(self, request: Request, block_index: int) -> bytes:
        return self._namespace + request.block_hashes[block_index].hash_value

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        block_size = self.kv_cache_spec.block_size
        self._stats["lookups"] += 1
        num_hits = 0
        for i in range(num_computed_tokens // block_size, (request.num_tokens - 1) // block_size):
            slot = self._index.get(self._key(request, i))
            if slot is None or not slot.ready:
                break
            num_hits += 1
        return num_hits * block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        block_size = self.kv_cache_spec.block_size
        first = request.num_computed_tokens // block_size - num_external_tokens // block_size
        for i in range(first, first + num_external_tokens // block_size):
            key = self._key(request, i)
            self._index[key].pins += 1  # present and ready: just looked up
            self._index.move_to_end(key)
            self._pending_loads.append((block_ids[i], key))
        self._stats["hit_blocks"] += num_external_tokens // block_size

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             scheduler: SchedulerView) -> OffloadingMetadata:
        meta = OffloadingMetadata(saves=self._pending_saves)
        self._pending_saves = {}
        keys = []
        for gpu_block, key in self._pending_loads:
            meta.load_gpu_blocks.append(gpu_block)
            meta.load_cpu_slots.append(self._index[key].slot_id)
            keys.append(key)
        self._pending_loads = []
        self._stats["loaded_blocks"] += len(keys)
        self._loads_in_flight.append(keys)
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict | None]:
        """Save the request's full blocks the tier lacks; hold them until that is done."""
        if request.status.name == "FINISHED_ERROR":
            return False, None  # its KV may be partly garbage (a failed load)
        block_size = self.kv_cache_spec.block_size
        # Blocks whose every token's KV is written: computed (or scheduled: the save is issued
        # after the compute stream's work so far) and known (drafts are not tokens).
        num_full = min(request.num_computed_tokens, request.num_tokens,
                       len(request.block_hashes) * block_size) // block_size
        gpu_blocks, cpu_slots, keys = [], [], []
        for i in range(num_full):
            key = self._key(request, i)
            if key in self._index:
                self._index.move_to_end(key)
                continue
            slot = self._allocate_slot(key)
            if slot is None:
                break  # every slot is pinned: save no more of it
            gpu_blocks.append(block_ids[i])
            cpu_slots.append(slot.slot_id)
            keys.append(key)
        if not keys:
            return False, None
        self._pending_saves[request.request_id] = (gpu_blocks, cpu_slots)
        self._saves_in_flight[request.request_id] = keys
        self._stats["saved_blocks"] += len(keys)
        return True, None

    def _allocate_slot(self, key: bytes) -> _Slot | None:
        if self._free_slots:
            slot = _Slot(self._free_slots.popleft())
        else:
            victim = next((k for k, s in self._index.items() if s.pins == 0 and s.ready), None)
            if victim is None:
                return None
            slot = _Slot(self._index.pop(victim).slot_id)
            self._stats["evicted_blocks"] += 1
        slot.pins = 1
        self._index[key] = slot
        return slot

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        # One report per planned step, in step order (the engine steps the workers every
        # step while a connector is configured): that step's loads are done.
        for key in self._loads_in_flight.popleft():
            self._index[key].pins -= 1
        for req_id in output.finished_sending:
            for key in self._saves_in_flight.pop(req_id, ()):
                slot = self._index[key]
                slot.ready = True
                slot.pins -= 1

    def get_stats(self) -> dict[str, float]:
        stats = dict(self._stats)
        stats["used_slots"] = len(self._index)
        stats["num_slots"] = self.num_slots
        return stats

    def check_integrity(self) -> None:
        """Slots are either free or indexed, never both; pins only while work is out."""
        indexed = [slot.slot_id for slot in self._index.values()]
        assert len(set(indexed)) == len(indexed), "a CPU slot is indexed twice"
        assert not set(indexed) & set(self._free_slots), "a CPU slot is free and indexed"
        assert len(indexed) + len(self._free_slots) == self.num_slots, "a CPU slot is lost"
        if not self._loads_in_flight and not self._saves_in_flight:
            pinned = [k for k, s in self._index.items() if s.pins]
            assert not pinned, f"{len(pinned)} CPU slots pinned with no transfer in flight"


class OffloadingConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        super().__init__(config, kv_cache_spec)
        self.num_slots = num_cpu_slots(config, kv_cache_spec)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.cpu_caches: dict[str, torch.Tensor] = {}
        self.mover: BlockMover | None = None
        self._load_events: dict[str, Any] = {}
        # Saves issued, by request, with what tells they are done (a CUDA event; None: done).
        self._sending: dict[str, Any] = {}
        self._stats: dict[str, float] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        import torch

        self.kv_caches = dict(kv_caches)
        first = next(iter(kv_caches.values()))
        for name, kv in kv_caches.items():
            # [num_slots, 2, block_size, heads, dim]: one slot's K and V are one chunk.
            shape = (self.num_slots, 2, *kv.shape[2:])
            self.cpu_caches[name] = torch.empty(shape, dtype=kv.dtype, device="cpu",
                                                pin_memory=first.is_cuda)
        self.mover = BlockMover(first.device)
        logger.info("CPU KV tier: %d blocks, %.2f GiB of %s host memory", self.num_slots,
                    self.num_slots * self.kv_cache_spec.bytes_per_block / 2**30,
                    "pinned" if first.is_cuda else "plain")

    def has_loads(self) -> bool:
        return bool(self._metadata is not None and self._metadata.load_gpu_blocks)

    def has_saves(self) -> bool:
        return False  # saves are whole requests' blocks at a step's start, not per layer

    def start_load_kv(self) -> None:
        meta: OffloadingMetadata | None = self._metadata
        self._load_events = {}
        if meta is None:
            return
        if meta.saves:
            gpu_blocks = [b for blocks, _ in meta.saves.values() for b in blocks]
            cpu_slots = [c for _, slots in meta.saves.values() for c in slots]
            done = self.mover.save(self.kv_caches, self.cpu_caches, gpu_blocks, cpu_slots)
            for req_id in meta.saves:
                self._sending[req_id] = done
            self._add_stat("save_bytes", len(gpu_blocks) * self.kv_cache_spec.bytes_per_block)
        if meta.load_gpu_blocks:
            self._add_stat("load_bytes", len(meta.load_gpu_blocks)
                           * self.kv_cache_spec.bytes_per_block)
            self._load_events = self.mover.load(self.kv_caches, self.cpu_caches,
                                                meta.load_gpu_blocks, meta.load_cpu_slots)

    def wait_for_layer_load(self, layer_name: str) -> None:
        event = self._load_events.pop(layer_name, None)
        if event is not None:
            self.mover.wait(event)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done = {req_id for req_id, event in self._sending.items()
                if event is None or event.query()}
        for req_id in done:
            del self._sending[req_id]
        return done, set()

    def get_stats(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        return stats

    def _add_stat(self, name: str, value: float) -> None:
        self._stats[name] = self._stats.get(name, 0.0) + value

    def shutdown(self) -> None:
        self.cpu_caches = {}
        self.kv_caches = {}
        self.mover = None


def slot_runs(cpu_slots: list[int]) -> list[tuple[int, int]]:
    """(first slot, length) of each run of consecutive slots: [3, 4, 5, 9] -> [(3, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for slot in cpu_slots:
        if runs and slot == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


class BlockMover:
    """Moves blocks between a paged cache layer ([2, num_blocks, block_size, heads, dim]) and a
    host store layer ([num_slots, 2, block_size, heads, dim]).

    On CUDA a layer's move is one copy per run of consecutive host slots, through a device
    staging buffer laid out like the host store, and one kernel that scatters the staging into
    (or gathers it from) the cache's blocks wherever they are: a few launches per layer however
    scattered the blocks are (a copy per block was thousands of launches for a long prompt).
    Loads run on one side stream and saves on another, each in stream order, so each needs one
    staging buffer; the compute stream waits for a layer's load event before its attention;
    saved blocks stay held until their save's event is done. On the CPU it is two index
    operations per layer.
    """

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.load_stream = torch.cuda.Stream(device=device)
            self.save_stream = torch.cuda.Stream(device=device)
        self._staging: dict[str, Any] = {}

    def block_ids(self, gpu_blocks: list[int], for_saves: bool = False) -> Any:
        """The block ids as an int64 tensor on the device (copied without blocking), allocated
        on the stream that uses it: the compute stream does not wait for the save stream, so a
        tensor of its own freed there could be reused while a save still reads it."""
        import torch

        ids = torch.tensor(gpu_blocks, dtype=torch.int64, pin_memory=self.cuda)
        if not self.cuda:
            return ids
        with torch.cuda.stream(self.save_stream if for_saves else self.load_stream):
            return ids.to(self.device, non_blocking=True)

    def _staging_for(self, name: str, num_blocks: int, like: Any) -> Any:
        """[num_blocks, 2, block_size, heads, dim] on the device, grown as needed."""
        import torch

        staging = self._staging.get(name)
        shape = (num_blocks, 2, *like.shape[2:])
        if staging is None or staging.shape[0] < num_blocks or staging.dtype != like.dtype:
            staging = torch.empty(shape, dtype=like.dtype, device=self.device)
            self._staging[name] = staging
        return staging[:num_blocks]

    def load(self, kv_caches: dict[str, Any], cpu_caches: dict[str, Any],
             gpu_blocks: list[int], cpu_slots: list[int]) -> dict[str, Any]:
        """Issue every layer's load; returns {layer_name: event} (empty on the CPU, where the
        loads are done on return)."""
        import torch

        if not self.cuda:
            slots = torch.tensor(cpu_slots, dtype=torch.int64)
            ids = torch.tensor(gpu_blocks, dtype=torch.int64)
            for name, kv in kv_caches.items():
                kv.transpose(0, 1).index_copy_(0, ids, cpu_caches[name].index_select(0, slots))
            return {}
        events = {}
        runs = slot_runs(cpu_slots)
        # The blocks were allocated for this step: whatever the compute stream queued before
        # (an earlier step that used them) must be done before they are overwritten. (A slot
        # is loadable only once its save was seen done, so no wait on the saves is needed.)
        self.load_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.load_stream):
            ids = self.block_ids(gpu_blocks)
            for name, kv in kv_caches.items():
                staging = self._staging_for("load", len(gpu_blocks), kv)
                offset = 0
                for slot, length in runs:
                    staging[offset:offset + length].copy_(cpu_caches[name][slot:slot + length],
                                                          non_blocking=True)
                    offset += length
                kv.transpose(0, 1).index_copy_(0, ids, staging)
                event = torch.cuda.Event()
                event.record()
                events[name] = event
        return events

    def wait(self, event: Any) -> None:
        import torch

        torch.cuda.current_stream().wait_event(event)

    def save(self, kv_caches: dict[str, Any], cpu_caches: dict[str, Any],
             gpu_blocks: list[int], cpu_slots: list[int]) -> Any:
        """Copy blocks `gpu_blocks` of every layer into host slots `cpu_slots`, after the
        compute stream's work so far; returns an event recorded after the copies (None on the
        CPU, where they are done on return). The blocks must not be reused before that."""
        import torch

        if not self.cuda:
            slots = torch.tensor(cpu_slots, dtype=torch.int64)
            ids = torch.tensor(gpu_blocks, dtype=torch.int64)
            for name, kv in kv_caches.items():
                cpu_caches[name].index_copy_(0, slots, kv.transpose(0, 1).index_select(0, ids))
            return None
        runs = slot_runs(cpu_slots)
        self.save_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.save_stream):
            ids = self.block_ids(gpu_blocks, for_saves=True)
            for name, kv in kv_caches.items():
                staging = self._staging_for("save", len(gpu_blocks), kv)
                torch.index_select(kv.transpose(0, 1), 0, ids, out=staging)
                offset = 0
                for slot, length in runs:
                    cpu_caches[name][slot:slot + length].copy_(staging[offset:offset + length],
                                                               non_blocking=True)
                    offset += length
            done = torch.cuda.Event()
            done.record()
        return done


class OffloadingConnector:
    """The CPU tier's two halves (see the module docstring)."""

    Scheduler = OffloadingConnectorScheduler
    Worker = OffloadingConnectorWorker
