"""The worker half of the pool connector: one per rank, with its own backend client and its own
registered host staging buffer (sluice/kv_transfer/pool/mover.py). Scheduler half, keys and the
reasons for the design: sluice/kv_transfer/pool/connector.py.

Per step (the runner's calls, sluice/worker/kv_connector.py):

- `start_load_kv`: the step's loads go to the load thread: values are fetched into the load half
  of the staging buffer in chunks (one batched get each; the backend splits batches to its
  per-call limits), each checked (a missing, wrong-size or corrupt value is a failed block) and
  moved into the cache (on CUDA: one copy per chunk and one scatter per layer on a load stream,
  the chunks double-buffered). From the shm tier (and SLUICE_POOL_DIRECT not 0) a load skips
  the host staging buffer (`_fetch_direct`): per chunk the backend pins the values in its arena
  (`get_pinned`) and starts their checks on framing's threads; meanwhile the mover copies them
  straight from the arena's mapping (CPU: into the cache blocks; CUDA: the mapping registered
  with the driver by the first load, one DMA per value into the device staging buffer and the
  scatters on the load stream); the load thread then waits for the checks and the DMA out of
  the arena, and only then unpins. A value refused by its check was copied but is a failed block
  (recomputed); a mapping that cannot be registered is one warning and the staged path. The
  step's saves get slots in the save half (fewer than planned
  when the half is full: the first blocks are kept, later ones dropped and counted).
  Asynchronous loads (`load_mode` "async": the plan names their requests) go to the same
  thread, but no layer of this step waits for them.
- `wait_for_layer_load(layer)`: waits for the load thread (every backend call it makes is bounded
  by `timeout_s`), then, on CUDA, orders the compute stream after that layer's scatter.
- `save_kv_layer(layer, kv)`: copies the layer's saved blocks toward their slots.
- `wait_for_save`: the gathers are complete as far as the blocks are concerned (they may be
  reused after this step); a copy thread then copies them to the host slots (CUDA: in 8 MiB
  pieces, one at a time, so the steps' own D2H copies do not queue behind them; the next
  step's gathers wait until that is done) and the save thread, after it, checks which keys
  the pool lacks and puts those (a failed put is only a lost cache entry: counted), and frees
  the slots.
- `get_finished`: the asynchronous loads that ended, in start order, once their fetch is back
  and (CUDA) their last scatter ran; their failed blocks are in the same step's errors.
- `get_block_ids_with_load_errors`: the blocks whose load failed, for the scheduler's recompute
  path (the runner does not sample rows that read them).

Faults: a backend error fails the rest of the step's loads (recomputed) and drops saves; the
client is then tried again only every `retry_interval_s` (saves dropped meanwhile), one warning
per outage. After a Mooncake call timed out, its native call may still read or write its slots:
slots of a timed-out put stay out of use until the backend is idle again (`busy`), and a
backend that is busy refuses calls before touching any slot, so loads cannot race a late get.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.config import KVTransferConfig
from sluice.core.kv_connector import KVCacheSpec
from sluice.kv_transfer.offloading import slot_runs
from sluice.kv_transfer.pool import PoolBackend, PoolError, PoolTimeout, value_size
from sluice.kv_transfer.pool.client import PoolClient, register_local_worker
from sluice.kv_transfer.pool.mover import StagingMover
from sluice.kv_transfer.pool.settings import PoolSettings, key_prefix, slot_stride
from sluice.worker.kv_connector import KVConnectorWorker

if TYPE_CHECKING:
    import torch

    from sluice.attention.metadata import AttentionMetadata
    from sluice.kv_transfer.pool.connector import PoolMetadata


logger = logging.getLogger("sluice")
# Staging buffers that a native call still running at shutdown may write into.
_KEPT_ALIVE: list[StagingMover] = []


def num_load_slots(num_slots: int) -> int:
    """The staging buffer's first half loads, the rest saves."""
    return num_slots // 2


class SlotAllocator:
    """Save slots: lowest free first (runs stay contiguous); slots of a put that timed out are
    held until the backend that timed out is idle."""

    def __init__(self, slots: range) -> None:
        self._free = set(slots)
        self._held: list[tuple[PoolBackend, list[int]]] = []
        self._lock = threading.Lock()

    def allocate(self, num: int) -> list[int]:
        with self._lock:
            still_held = []
            for backend, slots in self._held:
                if backend.busy:
                    still_held.append((backend, slots))
                else:
                    self._free.update(slots)
            self._held = still_held
            taken = sorted(self._free)[:num]
            self._free.difference_update(taken)
            return taken

    def release(self, slots: list[int], held_by: PoolBackend | None = None) -> None:
        with self._lock:
            if held_by is not None:
                self._held.append((held_by, list(slots)))
            else:
                self._free.update(slots)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)


@dataclass(slots=True)
class _StepSave:
    keys: list[str]
    slots: list[int]
    runs: list[tuple[int, int]]
    block_ids: Any  # the saved cache blocks as an int64 tensor (on the device)


class KVPoolConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        super().__init__(config, kv_cache_spec)
        self.settings = PoolSettings.from_config(config)
        self.prefix = key_prefix(kv_cache_spec, self.settings.model_id)
        self.stride = slot_stride(kv_cache_spec)
        self.num_slots = self.settings.num_staging_slots(kv_cache_spec)
        self.num_load_slots = num_load_slots(self.num_slots)
        self.payload_size = kv_cache_spec.bytes_per_block
        self.client: PoolClient | None = None
        self.mover: StagingMover | None = None
        self._save_slots = SlotAllocator(range(self.num_load_slots, self.num_slots))
        self._warned_staging_full = False
        self._load_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="sluice-pool-load")
        self._save_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="sluice-pool-save")
        self._load: concurrent.futures.Future | None = None
        # Asynchronous loads in flight: (their requests, the fetch's future), in start order.
        self._async_loads: list[tuple[list[str], concurrent.futures.Future]] = []
        self._layer_events: dict[str, Any] = {}
        self._half_free: list[Any] = [None, None]  # CUDA: host reads of each load half queued
        self._save: _StepSave | None = None
        # (CUDA) Saves' host copies, paced, on a thread of their own: neither waits for the
        # other's puts; the last step's copy, which the next step's gathers wait for.
        self._copy_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="sluice-pool-copy")
        self._copying: concurrent.futures.Future | None = None
        self._invalid: set[int] = set()
        self._stats: dict[str, float] = {}
        self._stats_lock = threading.Lock()
        # Loads from the shm arena read its mapping directly (no host staging copy) unless
        # SLUICE_POOL_DIRECT=0; other backends always load through the staging buffer.
        self._direct = os.environ.get("SLUICE_POOL_DIRECT", "1") != "0"

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.mover = StagingMover(kv_caches, self.num_slots, self.stride)
        mover = self.mover
        if self.settings.backend == "local":
            register_local_worker(self.config)

        # Only the first connection, made here before any step, may move the staging buffer
        # into memory the backend offers (a later one, from the retry thread, registers the
        # buffer in use: the backend copies through memory of its own).
        first_connection = [True]

        def on_connect(backend: PoolBackend) -> None:
            limit, needed = backend.max_value_size, value_size(self.payload_size)
            if limit is not None and limit < needed:
                raise ValueError(
                    f"KVPoolConnector: the {self.settings.backend} pool at {self.settings.url} "
                    f"takes values of at most {limit} bytes; a KV block of this model is "
                    f"{needed} (start `sluice pool-server` with --slot-bytes >= {needed})")
            if first_connection[0]:
                first_connection[0] = False
                shared = backend.host_memory(mover.nbytes)
                if shared is not None:
                    mover.use_host_memory(shared)
            backend.register_buffer(mover.host.data_ptr(), mover.nbytes)
            if self._direct and hasattr(backend, "mapped_arena"):
                # The arena's views (CUDA: its registration for DMA, ~1 s for 16 GiB) now, not
                # on the first load, which would pay for them and teach the rates that loading
                # is slow (every later hit recomputed).
                start = time.perf_counter()
                with backend.mapped_arena() as arena:
                    mover.arena_views(arena)
                logger.info("KV pool: the shm arena (%d bytes) mapped for direct loads in "
                            "%.2f s", arena.nbytes, time.perf_counter() - start)

        self.client = PoolClient(
            self.settings, f"worker (rank {self.kv_cache_spec.tp_rank})",
            "loads are recomputed, saves dropped", options=self.settings.backend_options,
            on_connect=on_connect)
        first_connection[0] = False

    # ---- loads ----

    def has_loads(self) -> bool:
        meta = self._metadata  # (asynchronous loads are not the step's)
        return bool(meta is not None and meta.load_block_ids and not meta.load_request_ids)

    def has_saves(self) -> bool:
        return self._save is not None  # (asked after start_load_kv took the save slots)

    def start_load_kv(self) -> None:
        meta: PoolMetadata | None = self._metadata
        self._layer_events = {}
        self._save = None
        if meta is None:
            return
        if meta.load_block_ids:
            keys = [self.prefix + h.hex() for h in meta.load_hashes]
            load = self._load_thread.submit(self._fetch, list(meta.load_block_ids), keys,
                                            self.mover.compute_marker())
            if meta.load_request_ids:
                self._async_loads.append((list(meta.load_request_ids), load))
            else:
                self._load = load
        if meta.save_block_ids:
            self._begin_save(list(meta.save_block_ids), meta.save_hashes)

    def _fetch(self, block_ids: list[int], keys: list[str], after: Any
               ) -> tuple[dict[str, Any], list[int]]:
        """The load thread: fetch, check and move every block; returns ({layer: event} (CUDA),
        the blocks that failed)."""
        start = time.perf_counter()
        backend = self.client.backend if self.client is not None else None
        direct = self._direct and hasattr(backend, "get_pinned")
        halves = 2 if self.mover.cuda else 1
        chunk = self.num_load_slots // halves
        if direct:
            chunk = max(1, min(chunk, backend.max_keys_per_call))
        failed: list[int] = []
        events: dict[str, Any] = {}
        num_loaded = num_unreachable = 0
        error: str | None = None if backend is not None else "unavailable"
        for index, first in enumerate(range(0, len(keys), chunk)):
            ids, chunk_keys = block_ids[first:first + chunk], keys[first:first + chunk]
            if error is not None:
                failed += ids
                num_unreachable += len(ids)
                continue
            if direct:
                try:
                    loaded = self._fetch_direct(backend, ids, chunk_keys, after)
                except PoolError as exc:
                    error = self.client.health.failed(exc)
                    failed += ids
                    num_unreachable += len(ids)
                    continue
                if loaded is not None:
                    self.client.health.succeeded()
                    good, chunk_events = loaded
                    failed += [b for b, ok in zip(ids, good) if not ok]
                    events = chunk_events or events
                    num_loaded += sum(good)
                    continue
                direct = False  # the arena cannot be read directly: the staged path from here
            half = index % halves
            if self._half_free[half] is not None:
                waited = time.perf_counter()
                self._half_free[half].synchronize()  # the host copy out of this half is done
                self._add_stat("pool_load_dma_wait_seconds", time.perf_counter() - waited)
            base = half * chunk
            stages, rejections = backend.stage_seconds(), backend.rejections()
            try:
                ok = backend.batch_get(chunk_keys, [(base + i) * self.stride
                                                    for i in range(len(ids))],
                                       [self.payload_size] * len(ids))
            except PoolError as exc:
                error = self.client.health.failed(exc)
                failed += ids
                num_unreachable += len(ids)
                continue
            self.client.health.succeeded()
            self._add_stage_stats("pool_load", stages, backend.stage_seconds())
            picks = [i for i, good in enumerate(ok) if good]
            failed += [b for b, good in zip(ids, ok) if not good]
            self._add_stat("pool_errors.load.missing", len(ids) - len(picks))
            # Of those, the values read and refused: wrong_size, corrupt, other_format.
            for kind, count in backend.rejections().items():
                self._add_stat(f"pool_errors.load.{kind}", count - rejections.get(kind, 0))
            # Each chunk's events come after the earlier chunks' (one load stream).
            events = self.mover.load(base, len(ids), picks, [ids[i] for i in picks],
                                     after) or events
            self._half_free[half] = self.mover.host_free_event()
            num_loaded += len(picks)
        if num_unreachable:
            self._add_stat(f"pool_errors.load.{error}", num_unreachable)
        self._add_stat("pool_loads", 1)
        self._add_stat("pool_load_blocks", num_loaded)
        self._add_stat("pool_load_bytes", num_loaded * self.payload_size)
        self._add_stat("pool_load_seconds", time.perf_counter() - start)
        return events, failed

    def _fetch_direct(self, backend: Any, ids: list[int], keys: list[str], after: Any
                      ) -> tuple[list[bool], dict[str, Any]] | None:
        """(The load thread.) One chunk straight from the shm arena: pin the values, copy
        each into its cache blocks (CUDA: DMA from the registered mapping into the device
        staging buffer, then the scatters) while framing's threads check them, wait for the
        copies out of the arena and for the checks, unpin. Returns (intact per key, {layer:
        event}); None where the arena cannot be read directly (nothing loaded: the caller
        loads the chunk through the staging buffer)."""
        stages, rejections = backend.stage_seconds(), backend.rejections()
        value = value_size(self.payload_size)
        with backend.get_pinned(keys, self.payload_size) as pinned:
            views = self.mover.arena_views(pinned.arena)
            if views is None:
                self._direct = False
                return None
            found = [i for i, (slot, size) in enumerate(zip(pinned.slots, pinned.sizes))
                     if slot >= 0 and size == value]
            start = time.perf_counter()
            # A value copied and then refused by its check is only a failed block: recomputed.
            events, copied = self.mover.load_direct(views, [pinned.slots[i] for i in found],
                                                    [ids[i] for i in found], after)
            # (get_copy as a staged load's: here the copies out of the arena, CUDA: queued.)
            self._add_stat("pool_load_get_copy_seconds", time.perf_counter() - start)
            try:
                good = pinned.checks()
            finally:
                if copied is not None:  # (also on an error: the pins go when this block ends)
                    waited = time.perf_counter()
                    copied.synchronize()  # the DMA out of the arena is done: the pins may go
                    self._add_stat("pool_load_dma_wait_seconds", time.perf_counter() - waited)
        self._add_stage_stats("pool_load", stages, backend.stage_seconds())
        self._add_stat("pool_errors.load.missing", len(ids) - sum(good))
        for kind, count in backend.rejections().items():
            self._add_stat(f"pool_errors.load.{kind}", count - rejections.get(kind, 0))
        return good, events

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._join_load()
        event = self._layer_events.pop(layer_name, None)
        if event is not None:
            self.mover.wait(event)

    def _join_load(self) -> None:
        if self._load is not None:
            # Every backend call of the load is bounded by timeout_s: this wait is too.
            load, self._load = self._load, None
            self._layer_events, failed = load.result()
            self._invalid.update(failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """The asynchronous loads whose fetch ended and whose copies ran on the device (their
        failed blocks go to the same report's errors). In start order: each load's device
        work follows the earlier ones' on the load stream."""
        done: set[str] = set()
        while self._async_loads:
            req_ids, load = self._async_loads[0]
            if not load.done():
                break
            events, failed = load.result()
            last = next(reversed(events.values()), None)  # (every layer's scatter before it)
            if last is not None and not last.query():
                break
            self._async_loads.pop(0)
            self._invalid.update(failed)
            done.update(req_ids)
        return set(), done

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._join_load()
        invalid, self._invalid = self._invalid, set()
        return invalid

    # ---- saves ----

    def _begin_save(self, block_ids: list[int], hashes: list[bytes]) -> None:
        client = self.client
        if client is None or client.backend is None or not client.health.should_try():
            self._add_stat("pool_errors.save.dropped", len(block_ids))
            return
        slots = self._save_slots.allocate(len(block_ids))
        # Lookups stop at the first missing block: keep the first ones.
        self._add_stat("pool_errors.save.dropped", len(block_ids) - len(slots))
        if len(slots) < len(block_ids) and not self._warned_staging_full:
            self._warned_staging_full = True
            logger.warning(
                "KVPoolConnector: %d of this step's %d saved blocks dropped: the save half of "
                "the host staging buffer is full (staging_bytes=%d; a step's saves need up to "
                "%d bytes per token it computes, and the half must hold the puts still in "
                "flight: raise kv_connector_extra_config.staging_bytes to about 4 x "
                "max_num_batched_tokens x that)", len(block_ids) - len(slots), len(block_ids),
                self.settings.staging_size(self.kv_cache_spec),
                self.stride // self.kv_cache_spec.block_size)
        if not slots:
            return
        # (CUDA) The last step's saves are out of the device staging buffer before this
        # step's gathers reuse it (copy_saves: ~12 ms for a 4k-token prompt of an 8B model).
        if self._copying is not None:
            self._copying.result()
        num = len(slots)
        self._save = _StepSave(keys=[self.prefix + h.hex() for h in hashes[:num]], slots=slots,
                               runs=slot_runs(slots),
                               block_ids=self.mover.save_ids(block_ids[:num]))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata | None) -> None:
        save = self._save
        if save is not None and layer_name in self.mover.layer_index:
            self.mover.save_layer(layer_name, kv_layer, save.block_ids, save.runs)

    def wait_for_save(self) -> None:
        self._join_load()
        save, self._save = self._save, None
        if save is None:
            return
        gathered = self.mover.finish_saves()
        copied = None
        if gathered is not None:
            copied = self._copying = self._copy_thread.submit(self.mover.copy_saves, save.runs,
                                                              gathered)
        self._save_thread.submit(self._put, save, copied)

    def _put(self, save: _StepSave, copied: concurrent.futures.Future | None) -> None:
        """The save thread: once the step's saves are on the host (CUDA), store the values the
        pool lacks, then free the slots."""
        if copied is not None:
            copied.result()
        start = time.perf_counter()
        backend = self.client.backend
        held_by = None
        try:
            if backend is None:
                raise _NoBackend
            stages = backend.stage_seconds()
            present = backend.batch_exists(save.keys)
            todo = [i for i, found in enumerate(present) if not found]
            stored = backend.batch_put([save.keys[i] for i in todo],
                                       [save.slots[i] * self.stride for i in todo],
                                       [self.payload_size] * len(todo))
        except _NoBackend:
            self._add_stat("pool_errors.save.dropped", len(save.keys))
        except PoolError as exc:
            kind = self.client.health.failed(exc)
            self._add_stat(f"pool_errors.save.{kind}", len(save.keys))
            if isinstance(exc, PoolTimeout):
                held_by = backend  # its native call may still read the slots
        else:
            self.client.health.succeeded()
            self._add_stage_stats("pool_save", stages, backend.stage_seconds())
            num_stored = sum(stored)
            self._add_stat("pool_saves", 1)
            self._add_stat("pool_save_blocks", num_stored)
            self._add_stat("pool_save_bytes", num_stored * self.payload_size)
            self._add_stat("pool_save_existing_blocks", len(save.keys) - len(todo))
            self._add_stat("pool_errors.save.failed", len(todo) - num_stored)
            self._add_stat("pool_save_seconds", time.perf_counter() - start)
        finally:
            self._save_slots.release(save.slots, held_by)

    def wait_for_pending_saves(self, timeout_s: float) -> bool:
        """Whether every save handed to the save thread so far is done within `timeout_s`
        (tests and benchmarks; the engine never waits for saves)."""
        return concurrent.futures.wait([self._save_thread.submit(lambda: None)],
                                       timeout_s).not_done == set()

    # ---- the rest ----

    def get_stats(self) -> dict[str, float]:
        with self._stats_lock:
            stats, self._stats = self._stats, {}
        return {name: value for name, value in stats.items() if value}

    def _add_stage_stats(self, prefix: str, before: dict[str, float],
                         after: dict[str, float]) -> None:
        """The backend's host stages of one call as stats: pool_load_get_copy_seconds, ..."""
        for stage, seconds in after.items():
            self._add_stat(f"{prefix}_{stage.replace('.', '_')}_seconds",
                           seconds - before.get(stage, 0.0))

    def _add_stat(self, name: str, value: float) -> None:
        with self._stats_lock:
            self._stats[name] = self._stats.get(name, 0.0) + value

    def shutdown(self) -> None:
        """Wait for the step's load, drop saves not started, close the client, give back the
        staging memory (pinned host memory included)."""
        self._load_thread.shutdown(wait=True)
        self._copy_thread.shutdown(wait=True)
        self._save_thread.shutdown(wait=True, cancel_futures=True)
        idle = True
        if self.client is not None:
            idle = self.client.close()
            self.client = None
        if self.mover is not None:
            if idle:
                self.mover.release()
            else:  # a native call may still write into it: never free it under that call
                logger.warning("KV pool: a transfer still runs at shutdown; keeping its %d-byte "
                               "staging buffer", self.mover.nbytes)
                _KEPT_ALIVE.append(self.mover)
            self.mover = None


class _NoBackend(Exception):
    """The client has no backend (not connected yet)."""
