"""Loads straight from the shm pool's arena (worker.py `_fetch_direct`, shm_store.py
`get_pinned`), through whole engines of the tiny float32 model on a real `sluice pool-server`:
the greedy output is unchanged, a value corrupted in the arena is a failed block and
recomputed, every pin is released (after a failed check too), a server killed during a load
still ends with the right output, and SLUICE_POOL_DIRECT=0 loads through the staging buffer."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from sluice import LLM
from sluice.kv_transfer.pool import create_backend
from sluice.testing import servers
from tests.kv_transfer.conftest import require
from tests.kv_transfer.test_pool_connector import (
    BLOCK,
    ENGINE,
    FULL,
    assert_all_blocks_back,
    assert_same_logprobs,
    greedy,
    pool_config,
    prompts,
    scheduler_half,
    stats,
    token_ids,
    wait_for_saves,
    worker_half,
)

pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def reference(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, **ENGINE)


def shm_llm(qwen3_dir: str, url: str) -> LLM:
    config = pool_config("shm", url=url, timeout_s=2.0, retry_interval_s=0.5)
    return LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)


def saved_then_uncached(llm: LLM, batch: list[dict]) -> None:
    llm.generate(batch, greedy(), use_tqdm=False)
    wait_for_saves(llm)
    assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()


@pytest.mark.parametrize("direct", ["1", "0"])
def test_loads_keep_the_greedy_output_and_release_every_pin(
        direct: str, qwen3_dir: str, reference: LLM, shm_pool: servers.ShmPoolServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_POOL_DIRECT", direct)
    batch = prompts(seed=11)
    expected = reference.generate(batch, greedy(), use_tqdm=False)
    llm = shm_llm(qwen3_dir, shm_pool.url)
    # The arena is mapped (CUDA: registered for DMA) when the worker connects, before any load.
    assert bool(worker_half(llm).mover._arena_views) == (direct == "1")
    saved_then_uncached(llm, batch)
    stats(llm)  # (the first run's counters)
    outputs = llm.generate(batch, greedy(), use_tqdm=False)
    assert token_ids(outputs) == token_ids(expected)
    assert_same_logprobs(outputs, expected)
    assert [o.num_cached_tokens for o in outputs] == [FULL, FULL]
    counters = stats(llm)
    assert counters["pool_load_blocks"] == 2 * FULL // BLOCK
    assert counters["pool_load_get_copy_seconds"] > 0
    assert counters["pool_load_get_checksum_seconds"] > 0
    if direct == "1":
        assert counters["pool_load_get_pin_seconds"] > 0
    else:
        assert "pool_load_get_pin_seconds" not in counters
    with create_backend(shm_pool.url, timeout_s=5.0) as backend:
        assert backend.stats().num_pinned == 0
    assert_all_blocks_back(llm)


def test_a_value_corrupted_in_the_arena_is_recomputed_and_its_pin_released(
        qwen3_dir: str, reference: LLM, shm_pool: servers.ShmPoolServer) -> None:
    batch = prompts(seed=12, count=1)
    expected = reference.generate(batch, greedy(), use_tqdm=False)
    llm = shm_llm(qwen3_dir, shm_pool.url)
    saved_then_uncached(llm, batch)
    scheduler = scheduler_half(llm)
    after_alloc = scheduler.update_state_after_alloc
    payload = worker_half(llm).payload_size

    def corrupt_block_3(request_: Any, block_ids: list[int], num_external_tokens: int) -> None:
        assert num_external_tokens == FULL
        key = scheduler.prefix + request_.block_hashes[3].hash_value.hex()
        with create_backend(shm_pool.url, timeout_s=5.0) as backend, \
                backend.get_pinned([key], payload) as pinned:
            assert pinned.checks() == [True]
            byte = ctypes.c_ubyte.from_address(pinned.addresses[0] + 100)
            byte.value ^= 0xFF  # behind the server's back: the arena is shared memory
        after_alloc(request_, block_ids, num_external_tokens)

    scheduler.update_state_after_alloc = corrupt_block_3
    stats(llm)
    outputs = llm.generate(batch, greedy(), use_tqdm=False)
    scheduler.update_state_after_alloc = after_alloc
    assert token_ids(outputs) == token_ids(expected)
    assert_same_logprobs(outputs, expected)
    assert outputs[0].num_cached_tokens == 3 * BLOCK
    counters = stats(llm)
    assert counters["pool_errors.load.corrupt"] == 1
    assert counters["pool_load_blocks"] == FULL // BLOCK - 1
    with create_backend(shm_pool.url, timeout_s=5.0) as backend:
        assert backend.stats().num_pinned == 0
    assert_all_blocks_back(llm)


def test_a_server_killed_during_a_load_still_ends_with_the_right_output(
        qwen3_dir: str, reference: LLM) -> None:
    require("shm")
    batch = prompts(seed=13)
    expected = reference.generate(batch, greedy(), use_tqdm=False)
    server = servers.start_shm_pool(capacity_bytes=64 << 20)
    try:
        llm = shm_llm(qwen3_dir, server.url)
        saved_then_uncached(llm, batch)
        backend = worker_half(llm).client.backend
        get_pinned, killed = backend.get_pinned, []

        def pin_then_kill(keys: list[str], payload_size: int) -> Any:
            pinned = get_pinned(keys, payload_size)
            if not killed:
                killed.append(True)
                server.kill()
            return pinned

        backend.get_pinned = pin_then_kill
        outputs = llm.generate(batch, greedy(), use_tqdm=False)
        assert killed
        assert token_ids(outputs) == token_ids(expected)
        assert_same_logprobs(outputs, expected)
        # The values pinned before the kill were read from the mapping, which outlives it.
        assert outputs[0].num_cached_tokens == FULL
        assert_all_blocks_back(llm)
    finally:
        server.stop()



def test_a_pinned_get_that_fails_after_its_grant_leaves_no_pin(
        qwen3_dir: str, shm_pool: servers.ShmPoolServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GetBegin pinned the values, then building the PinnedGet failed: the connection is
    dropped, and with it the server's pins."""
    import time

    batch = prompts(seed=13, count=1)
    llm = shm_llm(qwen3_dir, shm_pool.url)
    saved_then_uncached(llm, batch)
    scheduler = scheduler_half(llm)
    after_alloc = scheduler.update_state_after_alloc
    keys: list[str] = []

    def note_keys(request_: Any, block_ids: list[int], num_external_tokens: int) -> None:
        keys.extend(scheduler.prefix + h.hash_value.hex() for h in request_.block_hashes[:2])
        after_alloc(request_, block_ids, num_external_tokens)

    scheduler.update_state_after_alloc = note_keys
    llm.generate(batch, greedy(), use_tqdm=False)  # a pool hit: the keys are in the pool
    scheduler.update_state_after_alloc = after_alloc
    assert len(keys) == 2
    payload = worker_half(llm).payload_size
    with create_backend(shm_pool.url, timeout_s=5.0) as backend:
        def broken() -> Any:
            raise RuntimeError("no check thread")

        monkeypatch.setattr(backend, "_check_thread", broken)
        with pytest.raises(RuntimeError, match="no check thread"):
            backend.get_pinned(keys, payload)
        deadline = time.monotonic() + 5.0
        while backend.stats().num_pinned and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.stats().num_pinned == 0
