"""The scheduler's book of a KV connector's transfers (see sluice/core/kv_connector.py).

Which requests are loading KV, and how: synchronously, inside a step not yet returned (the
request is not scheduled again until it is), or asynchronously, parked in WAITING_FOR_REMOTE_KVS
until a worker reports the load done. Which finished requests still lend their blocks to a
send (`delay_free`, until a worker reports it in `finished_sending`). Which ended mid-load, so
that a load may still write their blocks (kept until the load reports done, or
`kv_load_abort_timeout_s` passes). Loaded blocks enter the prefix cache only once the load is
known good; a failed block truncates its request there (policy "recompute") or fails it
(policy "fail").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sluice.config import KVTransferConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_connector import KVConnectorScheduler
from sluice.core.outputs import FirstToken, KVConnectorOutput, SchedulerOutput
from sluice.core.request import Request, RequestStatus

logger = logging.getLogger("sluice")

# Ends a request with an error message (the scheduler takes it out of its queues).
FailRequest = Callable[[Request, str], None]


class KVTransfers:
    def __init__(self, connector: KVConnectorScheduler, config: KVTransferConfig,
                 kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self._loading: dict[str, Request] = {}  # sync (step out) or async (parked) loads
        self._async_loads: set[str] = set()  # of those, the asynchronous ones
        self._finished_recving: set[str] = set()  # async loads reported done, not promoted
        # Async loads reported done whose requests hold their blocks and are not admitted yet.
        self.loaded: set[str] = set()
        self._delayed_free: dict[str, Request] = {}
        self._abandoned_loads: dict[str, tuple[Request, float]] = {}  # (request, deadline)

    # ---- loads -------------------------------------------------------------------------

    def start_load(self, request: Request, block_ids: list[int], num_external: int,
                   load_async: bool) -> None:
        """The request owns its blocks; `num_external` tokens of them are to be loaded."""
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        self._loading[request.request_id] = request
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self._async_loads.add(request.request_id)

    def in_step_load(self, request_id: str) -> bool:
        """A synchronous load whose step has not returned (or a parked async one)."""
        return request_id in self._loading

    def load_done(self, request_id: str) -> bool:
        return request_id in self._finished_recving

    def num_parked(self) -> int:
        """Requests waiting for an asynchronous load that has not ended."""
        return len(self._async_loads) - len(self._finished_recving)

    def end_async_load(self, request: Request) -> None:
        """A finished asynchronous load: from WAITING_FOR_REMOTE_KVS back to WAITING (still at
        the head of the queue), its good blocks cached."""
        request_id = request.request_id
        self._finished_recving.discard(request_id)
        self._async_loads.discard(request_id)
        del self._loading[request_id]
        # The last token always computes (its logits are needed).
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING

    def end_sync_loads(self, scheduler_output: SchedulerOutput, failed: set[str]) -> None:
        """The step that loaded these requests' KV is back: their blocks are good now. (Every
        step's result comes here, so the connector hears of it here too.)"""
        self.connector.step_finished()
        if not self._loading:
            return
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self._loading.get(req_id)
            if request is None or req_id in failed:
                continue
            del self._loading[req_id]
            if not request.is_finished():
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)

    def forget(self, request_id: str) -> None:
        """A preempted request: a synchronous load still in flight writes blocks nobody will
        read, and the device runs it before any later step that may reuse them."""
        self._loading.pop(request_id, None)

    def admitted(self, request_id: str) -> None:
        """The request runs: its loaded blocks are a running request's now."""
        self.loaded.discard(request_id)

    # ---- the workers' report -----------------------------------------------------------

    def update(self, kv_output: KVConnectorOutput,
               fail: FailRequest) -> tuple[set[str], list[tuple[str, FirstToken]]]:
        """Apply the workers' report; returns the requests whose synchronous load failed in
        this step (their sampled tokens, computed over bad KV, are dropped), and the first
        tokens that ended asynchronous loads brought (the scheduler hands them out)."""
        failed: set[str] = set()
        if kv_output.invalid_block_ids:
            failed = self._handle_invalid_blocks(kv_output.invalid_block_ids, fail,
                                                 kv_output.load_errors)
        first_tokens = []
        for req_id in kv_output.finished_recving:
            abandoned = self._abandoned_loads.pop(req_id, None)
            if abandoned is not None:
                self.kv_cache_manager.free(abandoned[0])
            elif req_id in self._async_loads:
                self._finished_recving.add(req_id)
                self.loaded.add(req_id)
                first_token = kv_output.first_tokens.get(req_id)
                if first_token is not None:
                    first_tokens.append((req_id, first_token))
        for req_id in kv_output.finished_sending:
            request = self._delayed_free.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        self.connector.update_connector_output(kv_output)
        return failed, first_tokens

    def _handle_invalid_blocks(self, invalid_block_ids: set[int], fail: FailRequest,
                               load_errors: dict[str, str]) -> set[str]:
        """Truncate every loading request at its first block that failed to load: it computes
        from there again (policy "recompute") or ends with an error (policy "fail")."""
        failed: set[str] = set()
        block_size = self.kv_cache_manager.block_size
        for req_id, request in list(self._loading.items()):
            block_ids = self.kv_cache_manager.get_block_ids(req_id)
            bad = next((i for i, b in enumerate(block_ids) if b in invalid_block_ids), None)
            if bad is None:
                continue
            failed.add(req_id)
            bad_blocks = sorted(b for b in block_ids if b in invalid_block_ids)
            why = f": {load_errors[req_id]}" if req_id in load_errors else ""
            if self.config.kv_load_failure_policy == "fail":
                fail(request, f"KV load failed for blocks {bad_blocks} of request {req_id!r} "
                              f"(kv_load_failure_policy 'fail'){why}")
                continue
            logger.warning("KV load failed for blocks %s of request %r%s: recomputing from "
                           "token %d", bad_blocks, req_id, why, bad * block_size)
            request.num_computed_tokens = min(request.num_computed_tokens, bad * block_size)
            request.num_cached_tokens = min(request.num_cached_tokens, bad * block_size)
            if req_id not in self._async_loads:
                # A synchronous load in this step: its sampled token is dropped (the runner
                # did not sample it) and the step's tokens after the bad block recomputed.
                request.num_output_placeholders = 0
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
                del self._loading[req_id]
        return failed

    # ---- frees -------------------------------------------------------------------------

    def free(self, request: Request) -> dict[str, Any] | None:
        """Free a finished request's blocks, unless the connector still needs them (a send in
        progress, a load still writing them); returns its kv_transfer_params for the client."""
        request_id = request.request_id
        delay_free, params = self.connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request_id))
        self._loading.pop(request_id, None)
        self.loaded.discard(request_id)
        if request_id in self._async_loads:
            self._async_loads.discard(request_id)
            if request_id not in self._finished_recving:
                # Ended mid-load (aborted, failed): the load may still write the blocks.
                deadline = time.time() + self.config.kv_load_abort_timeout_s
                self._abandoned_loads[request_id] = (request, deadline)
                return params
            self._finished_recving.discard(request_id)
        if delay_free:
            self._delayed_free[request_id] = request
        else:
            self.kv_cache_manager.free(request)
        return params

    def free_expired(self, now: float) -> None:
        """Free the blocks of aborted loads that never reported done within the timeout."""
        for req_id, (request, deadline) in list(self._abandoned_loads.items()):
            if now >= deadline:
                logger.warning("request %r was aborted while its KV loaded and the load never "
                               "reported done: freeing its blocks after %.0f s", req_id,
                               self.config.kv_load_abort_timeout_s)
                del self._abandoned_loads[req_id]
                self.kv_cache_manager.free(request)

    def has_pending(self) -> bool:
        return bool(self._delayed_free or self._abandoned_loads)
