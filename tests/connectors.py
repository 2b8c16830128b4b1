"""A KV connector for contract tests, loaded by name like any connector of one's own:

    kv_transfer_config={"kv_connector": "InjectingConnector",
                        "kv_connector_module_path": "tests.connectors",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": N, ...}}

It is the CPU tier (sluice.kv_transfer.offloading) with faults and delays injected by its extra
config, so every load still moves real KV and a scheduler mistake shows as wrong tokens:

- "defer_lookups": {request_id: N} — answer None ("ask again next step") N times first;
- "load_async": true — loads are asynchronous: the worker copies a request's blocks in a
  background thread "load_delay_s" seconds later, then reports it in finished_recving (the
  slots stay pinned until then);
- "fail_blocks": [i, ...] — the i-th block (of the request) of every load fails: the worker
  writes garbage into it instead of its KV and reports it invalid;
- "delay_free_s": S — finished requests keep their blocks (delay_free); the worker reports the
  "send" done S seconds after it heard of the finish, and checks meanwhile that nobody
  overwrote the blocks (a violation is counted in the stats as "held_block_overwritten",
  which the tests assert stays 0).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import msgspec
import torch

from sluice.config import KVTransferConfig
from sluice.core.kv_connector import KVCacheSpec, SchedulerView
from sluice.core.outputs import KVConnectorOutput, SchedulerOutput
from sluice.core.request import Request
from sluice.kv_transfer.offloading import (
    OffloadingConnectorScheduler,
    OffloadingConnectorWorker,
    OffloadingMetadata,
)

_KEYS = ("cpu_bytes_to_use", "defer_lookups", "load_async", "load_delay_s", "fail_blocks",
         "delay_free_s")


class InjectingMetadata(OffloadingMetadata):
    # Asynchronous loads: per request, GPU blocks <- CPU slots.
    async_loads: dict[str, tuple[list[int], list[int]]] = msgspec.field(default_factory=dict)
    # GPU blocks whose load fails (garbage written, reported invalid).
    fail_gpu_blocks: list[int] = msgspec.field(default_factory=list)
    # Finished requests whose blocks the "send" holds: req_id -> block ids.
    sends: dict[str, list[int]] = msgspec.field(default_factory=dict)


def _options(config: KVTransferConfig) -> dict[str, Any]:
    extra = dict(config.kv_connector_extra_config)
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise ValueError(f"InjectingConnector: unknown keys {unknown}")
    return extra


def _offloading_config(config: KVTransferConfig) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_connector_extra_config={
        "cpu_bytes_to_use": config.kv_connector_extra_config["cpu_bytes_to_use"]})


class InjectingScheduler(OffloadingConnectorScheduler):
    metadata_type = InjectingMetadata

    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        super().__init__(_offloading_config(config), kv_cache_spec)
        self.config = config
        options = _options(config)
        self.defer_lookups = options.get("defer_lookups", {})
        self.load_async = options.get("load_async", False)
        self.fail_blocks = set(options.get("fail_blocks", ()))
        self.delay_free = options.get("delay_free_s") is not None
        self._lookups: dict[str, int] = {}
        self._async: dict[str, tuple[list[int], list[int]]] = {}
        self._async_keys: dict[str, list[bytes]] = {}
        self._fail: list[int] = []
        self._sends: dict[str, list[int]] = {}
        self.worker_stats: dict[str, float] = {}

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        seen = self._lookups.get(request.request_id, 0)
        self._lookups[request.request_id] = seen + 1
        if seen < self.defer_lookups.get(request.request_id, 0):
            return None, False
        num_tokens, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return num_tokens, self.load_async

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        before = len(self._pending_loads)
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        planned = self._pending_loads[before:]
        first = request.num_computed_tokens // self.kv_cache_spec.block_size - len(planned)
        self._fail += [gpu for i, (gpu, _) in enumerate(planned, first)
                       if i in self.fail_blocks]
        if self.load_async:
            # Sent as this request's async load; pinned until the worker reports it done.
            del self._pending_loads[before:]
            self._async[request.request_id] = ([gpu for gpu, _ in planned],
                                               [self._index[key].slot_id for _, key in planned])
            self._async_keys[request.request_id] = [key for _, key in planned]

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             scheduler: SchedulerView) -> InjectingMetadata:
        base = super().build_connector_meta(scheduler_output, scheduler)
        meta = InjectingMetadata(**msgspec.structs.asdict(base), async_loads=self._async,
                                 fail_gpu_blocks=self._fail, sends=self._sends)
        self._async, self._fail, self._sends = {}, [], {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        for name, value in output.stats.items():
            self.worker_stats[name] = self.worker_stats.get(name, 0.0) + value
        for req_id in output.finished_recving:
            for key in self._async_keys.pop(req_id, ()):
                self._index[key].pins -= 1

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict | None]:
        if not self.delay_free:
            return super().request_finished(request, block_ids)  # the tier's save
        self._sends[request.request_id] = list(block_ids)
        return True, {"held_blocks": list(block_ids)}


class InjectingWorker(OffloadingConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        super().__init__(_offloading_config(config), kv_cache_spec)
        options = _options(config)
        self.load_delay_s = options.get("load_delay_s", 0.0)
        self.delay_free_s = options.get("delay_free_s")
        self._lock = threading.Lock()
        self._recved: set[str] = set()
        self._sent: set[str] = set()
        self._invalid: set[int] = set()
        self._threads: list[threading.Thread] = []
        self._overwritten = 0

    def start_load_kv(self) -> None:
        meta: InjectingMetadata = self._metadata
        fail = set(meta.fail_gpu_blocks)
        super().start_load_kv()  # the synchronous loads (garbage for failing blocks below)
        for req_id, (gpu_blocks, cpu_slots) in meta.async_loads.items():
            self._start(self._load_later, req_id, gpu_blocks, cpu_slots, fail)
        for gpu in meta.fail_gpu_blocks:
            if not any(gpu in blocks for blocks, _ in meta.async_loads.values()):
                self._spoil([gpu])
        for req_id, block_ids in meta.sends.items():
            self._start(self._send_later, req_id, block_ids)

    def _start(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _load_later(self, req_id: str, gpu_blocks: list[int], cpu_slots: list[int],
                    fail: set[int]) -> None:
        time.sleep(self.load_delay_s)
        good = [(g, c) for g, c in zip(gpu_blocks, cpu_slots) if g not in fail]
        if good:  # (on the CPU: copied when this returns)
            self.mover.load(self.kv_caches, self.cpu_caches, [g for g, _ in good],
                            [c for _, c in good])
        self._spoil([g for g in gpu_blocks if g in fail])
        with self._lock:
            self._recved.add(req_id)

    def _spoil(self, gpu_blocks: list[int]) -> None:
        for kv in self.kv_caches.values():
            for gpu in gpu_blocks:
                kv[:, gpu].fill_(100.0)
        with self._lock:
            self._invalid.update(gpu_blocks)

    def _send_later(self, req_id: str, block_ids: list[int]) -> None:
        before = {name: kv[:, block_ids].clone() for name, kv in self.kv_caches.items()}
        time.sleep(self.delay_free_s)
        overwritten = any(not torch.equal(kv[:, block_ids], before[name])
                          for name, kv in self.kv_caches.items())
        with self._lock:
            self._sent.add(req_id)
            if overwritten:  # a held block was reused while the "send" read it
                self._overwritten += 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        saved, _ = super().get_finished(finished_req_ids)  # the tier's saves
        with self._lock:
            sent, recved = self._sent, self._recved
            self._sent, self._recved = set(), set()
        return sent | saved, recved

    def get_stats(self) -> dict[str, float]:
        stats = super().get_stats()
        with self._lock:
            stats["held_block_overwritten"] = self._overwritten
            self._overwritten = 0
        return stats

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid = self._invalid, set()
        return invalid


class InjectingConnector:
    Scheduler = InjectingScheduler
    Worker = InjectingWorker


# ---- helpers of the connector tests ----


def count_computed_tokens(llm: Any) -> dict[str, int]:
    """Tokens the model computes per request id, seen where the step messages leave."""
    executor = llm.llm_engine.engine_core.executor
    counts: dict[str, int] = defaultdict(int)
    execute_model = executor.execute_model

    def counting(scheduler_output: SchedulerOutput):  # noqa: ANN202
        for req_id, num in scheduler_output.num_scheduled_tokens.items():
            counts[req_id] += num
        return execute_model(scheduler_output)

    executor.execute_model = counting
    return counts
