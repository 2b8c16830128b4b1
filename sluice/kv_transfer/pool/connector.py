"""The global KV pool connector: instances that share a pool (Redis, Mooncake Store, or the
in-process `local` store) load the KV of each other's prompts instead of recomputing it.

    kv_transfer_config={"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"backend": "mooncake",
                                                      "url": "mooncake://127.0.0.1:50051"}}

`kv_role`: `kv_both` saves and loads, `kv_producer` only saves, `kv_consumer` only loads. Other
keys of `kv_connector_extra_config` (settings.py): `on_backend_error` ("fail" | "recompute"),
`timeout_s`, `lookup_timeout_s`, `staging_bytes`, `retry_interval_s`, `model_id`,
`load_policy` ("auto" | "always" | "never"), and the
backend's own options (e.g. Mooncake's `global_segment_size`).

Values and keys. A value is one full block of this rank's KV over every layer,
[num_layers, 2, block_size, heads, dim], under a content-addressed key (settings.key_prefix plus
the chained block hash in hex). One key per block rather than per (block, layer): per-object
overhead is what made Mooncake Store slower than recomputing for its users (Mooncake#467), and a
block of a real model is already a good object size (Qwen3-8B: 36 layers x 64 KiB = 2.25 MiB per
16-token block; per layer it would be 64 KiB, and a 32k-token prompt 73,728 objects instead of
2,048, with 36 times the keys to look up). The price: a block's layers arrive together, so the
network fetch of a step's loads precedes its first layer; what is layer by layer is the device
side (each layer's scatter into the cache has its own event), and in a pool hit the step computes
at most a block of the prompt anyway, so there is little compute to hide a fetch behind.

Loads are asynchronous by default (`load_mode` "async", as LMCache's and vLLM's async loads):
the request waits in WAITING_FOR_REMOTE_KVS while the worker's load thread fetches its blocks
and its load stream writes them, and the other requests' steps go on; the worker reports the
request done once the copies have run on the device, and its next step computes the rest. A
load of 256 blocks of an 8B model takes ~30 ms at 20 GB/s; inside a step it stalls every
request in the batch that long. `load_mode` "sync" loads inside the step of the request's
first new tokens, as the CPU tier's: started before the forward (the fetch runs on a thread
while the step's inputs are prepared) and waited on per layer.

Scheduler half (here): `get_num_new_matched_tokens` asks the pool, in ONE batched existence
query through the scheduler's own client (a short `lookup_timeout_s`; for Mooncake a client that
owns no pool memory), about the request's full blocks, and counts the leading run present after
the local prefix-cache hit; it loads that run only if loading is expected to be faster than
recomputing it, from the rates this instance measured (rates.py: its steps' prefill time per
token, its loads' time per block; `load_policy` "always" / "never" overrides; skipped hits are
counted, `pool_skipped_hit_blocks`). Local hits the pool lacks (it evicted them, or restarted
empty) are saved again. A timeout or an unreachable pool is a miss, never a stall; after a
failure the pool is asked again only every `retry_interval_s` (misses meanwhile), with one
warning per outage. A block present at lookup but gone at load (evicted, its owner gone) fails
to load: the scheduler truncates the request there and recomputes. The plan of each step
(`PoolMetadata`) carries the loads (cache block <- block hash) and the saves: every full block
not saved yet (blocks computed in the step, and local hits the pool lacked) that was not loaded,
at most the worker's save slots per step (the rest in a later step; the worker's put skips keys
present). Ranks make their own keys from the hashes (the tensor-parallel rank is in the key).

Worker half: worker.py. The halves' counters come together in `get_stats` (the workers report
theirs with every step), which the engine core sends to /metrics as `sluice:kv_pool_*`.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

import msgspec

from sluice.config import KVTransferConfig
from sluice.core.kv_connector import KVCacheSpec, KVConnectorScheduler, SchedulerView
from sluice.core.outputs import KVConnectorOutput, SchedulerOutput
from sluice.kv_transfer.pool import PoolError
from sluice.kv_transfer.pool.client import PoolClient, has_local_worker
from sluice.kv_transfer.pool.rates import LoadOrRecompute
from sluice.kv_transfer.pool.settings import PoolSettings, key_prefix
from sluice.kv_transfer.pool.worker import KVPoolConnectorWorker, num_load_slots

if TYPE_CHECKING:
    from sluice.core.request import Request


class PoolMetadata(msgspec.Struct):
    """One step's transfers: cache block load_block_ids[i] <- the value of load_hashes[i]; the
    value of cache block save_block_ids[i] -> save_hashes[i]. Hashes are chained block hashes;
    each rank turns them into its own keys."""

    load_block_ids: list[int] = msgspec.field(default_factory=list)
    load_hashes: list[bytes] = msgspec.field(default_factory=list)
    # Asynchronous loads (load_mode "async"): the loads above belong, in order, to these
    # requests, load_request_blocks[i] blocks each; empty: the loads are this step's own.
    load_request_ids: list[str] = msgspec.field(default_factory=list)
    load_request_blocks: list[int] = msgspec.field(default_factory=list)
    save_block_ids: list[int] = msgspec.field(default_factory=list)
    save_hashes: list[bytes] = msgspec.field(default_factory=list)


class KVPoolConnectorScheduler(KVConnectorScheduler):
    metadata_type = PoolMetadata

    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        super().__init__(config, kv_cache_spec)
        self.settings = settings = PoolSettings.from_config(config)
        self.prefix = key_prefix(kv_cache_spec, settings.model_id)
        num_slots = settings.num_staging_slots(kv_cache_spec)
        self.max_save_blocks_per_step = num_slots - num_load_slots(num_slots)
        self.client: PoolClient | None = None
        if settings.backend == "local" and not has_local_worker(config):
            raise ValueError("KVPoolConnector: the local pool backend lives in one process and "
                             "this engine's workers run in others (the mp executor); use a "
                             "redis or mooncake pool")
        if config.is_consumer:
            options = dict(settings.backend_options)
            if settings.backend == "mooncake":
                options["global_segment_size"] = 0  # lookups only: no pool memory of its own
            if str(options.get("remote_url", "")).startswith("mooncake://"):
                options["remote_options"] = {**options.get("remote_options", {}),
                                             "global_segment_size": 0}
            self.client = PoolClient(settings, "scheduler", "lookups are misses",
                                     options=options, call_timeout_s=settings.lookup_timeout_s)
        self.load_async = settings.load_mode == "async"
        # (cache block, hash, request) for the plan
        self._pending_loads: list[tuple[int, bytes, str]] = []
        # Per live request: its full blocks before this index were considered for saving.
        self._num_considered: dict[str, int] = {}
        self._stats: dict[str, float] = {}
        self._worker_stats: dict[str, float] = {}
        self.rates = LoadOrRecompute(settings.load_policy, kv_cache_spec.block_size)
        # Per step planned and not finished yet: (when, tokens, whether it loads).
        self._planned: collections.deque[tuple[float, int, bool]] = collections.deque(maxlen=64)

    # ---- lookups ----

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        block_size = self.kv_cache_spec.block_size
        first = num_computed_tokens // block_size
        # Saves start after the local hit (those blocks were offered to the pool when they were
        # computed), unless the lookup finds the pool lacks some of them (below).
        self._num_considered[request.request_id] = first
        client = self.client
        end = (request.num_tokens - 1) // block_size  # never the block of the last token
        if client is None or end == 0:
            return 0, False
        if first < end:
            self._add("pool_lookups", 1)
            self._add("pool_lookup_blocks", end - first)
        backend = client.backend
        if backend is None or not client.health.should_try():
            return 0, False
        # One query for every full block: the local hit's too, so that blocks the pool lost
        # (evicted, or a pool restarted empty) while this instance kept them are offered again.
        keys = [self.prefix + request.block_hashes[i].hash_value.hex() for i in range(end)]
        start = time.perf_counter()
        try:
            present = backend.batch_exists(keys)
        except PoolError as exc:
            self._add(f"pool_errors.lookup.{client.health.failed(exc)}", 1)
            return 0, False
        finally:
            self._add("pool_lookup_seconds", time.perf_counter() - start)
        client.health.succeeded()
        first_missing = next((i for i, found in enumerate(present[:first]) if not found), first)
        if first_missing < first:
            self._num_considered[request.request_id] = first_missing
            self._add("pool_missing_local_blocks", first - first_missing)
        after = present[first:]
        num_hits = next((i for i, found in enumerate(after) if not found), len(after))
        self._add("pool_hit_blocks", num_hits)
        if num_hits and not self.rates.should_load(num_hits):
            self._add("pool_skipped_hits", 1)
            self._add("pool_skipped_hit_blocks", num_hits)
            return 0, False
        return num_hits * block_size, self.load_async

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        block_size = self.kv_cache_spec.block_size
        num_blocks = num_external_tokens // block_size
        first = request.num_computed_tokens // block_size - num_blocks
        for i in range(first, first + num_blocks):
            self._pending_loads.append((block_ids[i], request.block_hashes[i].hash_value,
                                        request.request_id))
        # Loaded blocks are in the pool already (unless blocks before them are to be offered
        # again: saves cover one run of blocks, so those go again too; the put skips them).
        if self._num_considered.get(request.request_id, first) >= first:
            self._num_considered[request.request_id] = first + num_blocks

    # ---- the step's plan ----

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             scheduler: SchedulerView) -> PoolMetadata:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._num_considered.pop(req_id, None)  # (preempted: looked up again on return)
        meta = PoolMetadata(load_block_ids=[b for b, _, _ in self._pending_loads],
                            load_hashes=[h for _, h, _ in self._pending_loads])
        if self.load_async:
            for _, _, req_id in self._pending_loads:
                if meta.load_request_ids and meta.load_request_ids[-1] == req_id:
                    meta.load_request_blocks[-1] += 1
                else:
                    meta.load_request_ids.append(req_id)
                    meta.load_request_blocks.append(1)
        self._pending_loads = []
        # (An asynchronous load is not the step's: the step's time stays a recompute rate.)
        self._planned.append((time.perf_counter(), scheduler_output.total_num_scheduled_tokens,
                              bool(meta.load_block_ids) and not self.load_async))
        if not self.config.is_producer:
            return meta
        block_size = self.kv_cache_spec.block_size
        room = self.max_save_blocks_per_step
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            if room == 0:
                break
            request = scheduler.requests[req_id]
            # Known tokens only (drafts are not the request's tokens yet); the prompt's
            # unless save_decode_blocks.
            known = (request.num_tokens if self.settings.save_decode_blocks
                     else request.num_prompt_tokens)
            num_full = min(request.num_computed_tokens + num_new, known) // block_size
            first = self._num_considered.get(req_id, 0)
            if num_full <= first:
                continue
            last = min(num_full, first + room)
            self._num_considered[req_id] = last  # the rest, if any, in a later step
            block_ids = scheduler.get_block_ids(req_id)
            for i in range(first, last):
                meta.save_block_ids.append(block_ids[i])
                meta.save_hashes.append(request.block_hashes[i].hash_value)
            room -= last - first
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for name, value in output.stats.items():
            self._worker_stats[name] = self._worker_stats.get(name, 0.0) + value
        self.rates.load_done(output.stats.get("pool_load_seconds", 0.0),
                             output.stats.get("pool_load_blocks", 0.0))

    def step_finished(self) -> None:
        # The step's time runs to its result: a report taken at launch (async scheduling)
        # comes before the device has run the step.
        if self._planned:  # (results come in step order, one per planned step)
            planned_at, num_tokens, had_loads = self._planned.popleft()
            self.rates.step_done(self.rates.step_seconds(planned_at), num_tokens, had_loads)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict | None]:
        # Saves copy the blocks out within their step: nothing holds them after it.
        self._num_considered.pop(request.request_id, None)
        return False, None

    # ---- the rest ----

    def get_stats(self) -> dict[str, float]:
        stats = {**self._worker_stats, **self._stats}
        for name, rate in (("pool_load_seconds_per_block", self.rates.seconds_per_block),
                           ("pool_recompute_seconds_per_token", self.rates.seconds_per_token)):
            if rate is not None:
                stats[name] = rate
        client = self.client
        if client is not None:  # (a producer only saves: its workers report errors)
            stats["pool_available"] = float(client.backend is not None and client.health.up)
            stats["pool_outages"] = float(client.health.num_outages)
        return stats

    def _add(self, name: str, value: float) -> None:
        self._stats[name] = self._stats.get(name, 0.0) + value

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


class KVPoolConnector:
    """The pool connector's two halves (see the module docstring)."""

    Scheduler = KVPoolConnectorScheduler
    Worker = KVPoolConnectorWorker
