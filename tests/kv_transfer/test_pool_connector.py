"""The global KV pool connector (KVPoolConnector) through whole engines with the tiny float32
model: instances on one pool (in this process, in another process) load what another computed
and keep the greedy output of an engine without the pool; roles; evicted and corrupt values;
a pool that is down at start, stalls or comes back; every block back after each test."""

from __future__ import annotations

import json
import logging
import os
import random
import struct
import subprocess
import sys
import time
import uuid
import zlib
from typing import Any

import pytest

from sluice import LLM, SamplingParams
from sluice.core.kv_connector import KVCacheSpec
from sluice.engine.stats import SchedulerStats, StatsLogger
from sluice.entrypoints.openai.metrics import PrometheusStatsListener
from sluice.kv_transfer.pool.framing import TRAILER_SIZE
from sluice.kv_transfer.pool.settings import PoolSettings, key_prefix, slot_stride
from sluice.kv_transfer.pool.worker import SlotAllocator
from sluice.testing import servers
from tests.connectors import count_computed_tokens
from tests.kv_transfer.conftest import require

pytestmark = pytest.mark.serial

BLOCK = 16
PROMPT_LEN = 160  # 10 blocks; the 9 before the last token's can come from the pool
FULL = (PROMPT_LEN - 1) // BLOCK * BLOCK
MAX_TOKENS = 8
ENGINE = dict(dtype="float32", block_size=BLOCK, max_model_len=320, seed=0,
              num_gpu_blocks_override=64)
# A block of the test model: 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
STAGING = 2 << 20  # ~480 slots: a test never runs out of save slots


def prompts(seed: int, count: int = 2, length: int = PROMPT_LEN) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, 400) for _ in range(length)]}
            for _ in range(count)]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_same_logprobs(outputs: list, expected: list) -> None:
    """The chosen tokens' logprobs match the reference's (a wrong KV block moves them)."""
    for out, ref in zip(outputs, expected):
        for got, want, token in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs,
                                    ref.outputs[0].token_ids):
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def reference(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, **ENGINE)


def pool_config(kind: str, request: pytest.FixtureRequest | None = None, role: str = "kv_both",
                **extra: Any) -> dict:
    """A KVPoolConnector config on the session's server of `kind`, in a key namespace of the
    test's own (model_id), so tests never see each other's blocks."""
    # load_policy always: these tests are of the load path (the choice: test_pool_choice.py).
    options: dict[str, Any] = {"backend": kind, "staging_bytes": STAGING, "timeout_s": 2.0,
                               "lookup_timeout_s": 1.0, "model_id": f"m-{uuid.uuid4().hex[:8]}",
                               "load_policy": "always"}
    if kind == "redis":
        options["url"] = request.getfixturevalue("redis_server").url
    elif kind == "mooncake":
        master = request.getfixturevalue("mooncake_master")
        request.getfixturevalue("mooncake_segment_owner")  # the pool's memory
        options.update(url=master.url, global_segment_size=0, admin_port=master.admin_port)
    elif kind == "mooncake-dummy":  # a dummy client of the session's real client
        master = request.getfixturevalue("mooncake_master")
        real_client = request.getfixturevalue("mooncake_real_client")
        options.update(backend="mooncake", url=master.url, client="dummy",
                       real_client=real_client.address, admin_port=master.admin_port)
    options.update(extra)
    return {"kv_connector": "KVPoolConnector", "kv_role": role,
            "kv_connector_extra_config": options}


def worker_half(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.executor.worker.connector


def scheduler_half(llm: LLM) -> Any:
    return llm.llm_engine.scheduler.connector


def wait_for_saves(llm: LLM) -> None:
    assert worker_half(llm).wait_for_pending_saves(10.0), "saves did not finish"


def assert_all_blocks_back(llm: LLM) -> None:
    manager = llm.llm_engine.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1


@pytest.mark.parametrize("save_decode", [False, True])
def test_the_blocks_an_output_fills_are_saved_only_when_asked(qwen3_dir: str,
                                                             save_decode: bool) -> None:
    """A 160-token prompt (10 blocks) and 40 output tokens, which fill 2 blocks more: the
    prompt's blocks are saved, the output's only with save_decode_blocks (LMCache's
    save_decode_cache, off by default)."""
    config = pool_config("local", save_decode_blocks=save_decode)
    llm = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    try:
        llm.generate(prompts(seed=24, count=1), greedy(max_tokens=40), use_tqdm=False)
        counters = stats(llm)
        assert counters["pool_save_blocks"] == PROMPT_LEN // BLOCK + (2 if save_decode else 0)
        assert_all_blocks_back(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


def stats(llm: LLM) -> dict[str, float]:
    wait_for_saves(llm)
    llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return scheduler_half(llm).get_stats()  # (worker counters come back with a step)


def spec_of(llm: LLM) -> KVCacheSpec:
    return llm.llm_engine.engine_core.executor.kv_cache_spec


# ---- settings and keys ----


def settings(**extra: Any) -> PoolSettings:
    from sluice.config import KVTransferConfig

    return PoolSettings.from_config(KVTransferConfig(
        kv_connector="KVPoolConnector", kv_connector_extra_config=extra))


def test_settings_are_validated() -> None:
    assert settings().backend == "local"
    cases = [({"backend": "memcached"}, "backend must be one of .* got 'memcached'"),
             ({"backend": "redis"}, "redis backend needs .*url"),
             ({"backend": "redis", "url": "mooncake://127.0.0.1:1"}, "is not a redis address"),
             ({"backend": "redis", "url": "redis://h:notaport"}, "bad pool URL"),
             ({"on_backend_error": "ignore"}, "on_backend_error must be .* got 'ignore'"),
             ({"lookup_timeout_s": 0}, "lookup_timeout_s must be .* got 0"),
             ({"timeout_s": "5"}, "timeout_s must be .* got '5'"),
             ({"staging_bytes": -1}, "staging_bytes must be .* got -1"),
             ({"model_id": ""}, "model_id must be a non-empty string"),
             ({"save_decode_blocks": 1}, "save_decode_blocks must be true or false, got 1"),
             ({"load_mode": "lazy"}, r"load_mode must be one of \['async', 'sync'\], got 'lazy'"),
             ({"segment_size": 1}, r"unknown kv_connector_extra_config keys \['segment_size'\]"),
             # Another backend's option is unknown here.
             ({"backend": "redis", "url": "redis://h:1", "global_segment_size": 0},
              "unknown .*global_segment_size.*redis backend's options")]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            settings(**extra)
    spec = KVCacheSpec("m", "float32", BLOCK, 2, 16, ("a", "b"))
    with pytest.raises(ValueError, match=r"staging_bytes \(1000\) holds 0 KV blocks; it needs "
                                         "at least 4"):
        settings(staging_bytes=1000).num_staging_slots(spec)
    assert settings(backend="mooncake", url="mooncake://h:1",
                    global_segment_size=0).backend_options == {"global_segment_size": 0}


def test_default_staging_holds_a_step_of_loads_and_two_of_saves() -> None:
    """Without staging_bytes the buffer is sized from the step (Qwen3-0.6B at 8,192 tokens a
    step: 0.94 GB of KV; a fixed 256 MiB dropped 70% of such a step's saves on an H100)."""
    spec = KVCacheSpec("m", "bfloat16", 16, 8, 128, tuple(f"l{i}" for i in range(28)),
                       max_tokens_per_step=8192)
    step_bytes = 8192 // 16 * slot_stride(spec)
    assert settings().staging_size(spec) == 4 * step_bytes
    assert settings().num_staging_slots(spec) // 2 == 2 * 8192 // 16  # the save half
    assert settings(staging_bytes=1 << 28).staging_size(spec) == 1 << 28  # as given
    small = KVCacheSpec("m", "float32", BLOCK, 2, 16, ("a", "b"), max_tokens_per_step=64)
    assert settings().staging_size(small) == 256 << 20  # the floor


def test_keys_name_every_property_of_the_bytes() -> None:
    base = KVCacheSpec("/models/Qwen3-8B", "bfloat16", 16, 8, 128, tuple(f"l{i}"
                                                                        for i in range(36)))
    prefix = key_prefix(base)
    assert prefix.startswith("sluice/Qwen3-8B/") and prefix.endswith("/tp0-1/")
    others = [KVCacheSpec("/models/Qwen3-8B-ft", "bfloat16", 16, 8, 128, base.layer_names),
              KVCacheSpec("/models/Qwen3-8B", "float16", 16, 8, 128, base.layer_names),
              KVCacheSpec("/models/Qwen3-8B", "bfloat16", 32, 8, 128, base.layer_names),
              KVCacheSpec("/models/Qwen3-8B", "bfloat16", 16, 4, 128, base.layer_names),
              KVCacheSpec("/models/Qwen3-8B", "bfloat16", 16, 8, 128, base.layer_names[:35]),
              KVCacheSpec("/models/Qwen3-8B", "bfloat16", 16, 8, 128, base.layer_names,
                          tp_rank=1, tp_size=2),
              KVCacheSpec("/models/Qwen3-8B", "bfloat16", 16, 8, 128, base.layer_names,
                          layout="other")]
    assert len({prefix, *(key_prefix(s) for s in others)}) == 1 + len(others)
    # model_id names the model instead of its path: instances with other paths share.
    assert key_prefix(base, "qwen3-8b") == key_prefix(
        KVCacheSpec("/elsewhere/q", "bfloat16", 16, 8, 128, base.layer_names), "qwen3-8b")
    # A slot holds one value (payload + 16-byte trailer), aligned to 256 bytes.
    assert slot_stride(base) == -(-(base.bytes_per_block + 16) // 256) * 256


def test_slots_of_a_timed_out_put_stay_out_of_use_until_the_backend_is_idle() -> None:
    class Backend:
        busy = True

    backend = Backend()
    slots = SlotAllocator(range(10, 16))
    first = slots.allocate(4)
    assert first == [10, 11, 12, 13]
    slots.release(first[:2])
    slots.release(first[2:], held_by=backend)  # a put of 12, 13 timed out
    assert slots.allocate(6) == [10, 11, 14, 15]
    backend.busy = False
    assert slots.allocate(6) == [12, 13]


def test_pool_counters_reach_metrics_and_the_stats_line() -> None:
    listener = PrometheusStatsListener("tiny")
    from sluice.engine.stats import IterationStats

    pool = {"pool_lookups": 2, "pool_lookup_blocks": 20, "pool_hit_blocks": 10,
            "pool_load_bytes": 4096, "pool_errors.load.missing": 1, "pool_available": 1}
    listener(IterationStats(timestamp=0.0), SchedulerStats(kv_connector=pool,
                                                           num_scheduled_tokens_total=50))
    text = listener.render().decode()
    for line in ('sluice:kv_pool_lookups_total{model_name="tiny"} 2.0',
                 'sluice:kv_pool_hit_blocks_total{model_name="tiny"} 10.0',
                 'sluice:kv_pool_load_bytes_total{model_name="tiny"} 4096.0',
                 'sluice:kv_pool_errors_total{kind="missing",model_name="tiny",op="load"} 1.0',
                 'sluice:kv_pool_available{model_name="tiny"} 1.0',
                 'sluice:scheduled_tokens_total{model_name="tiny"} 50.0'):
        assert line in text, line
    logger = StatsLogger()
    logger(IterationStats(timestamp=0.0, num_prompt_tokens=10),
           SchedulerStats(num_running=1, kv_connector=pool))
    assert "KV pool hit rate 50.0%" in logger.log()


# ---- instances on one pool ----


def test_a_consumer_loads_what_a_producer_computed_in_chunks(
        qwen3_dir: str, reference: LLM, request: pytest.FixtureRequest) -> None:
    """Two engines of this process on the in-process pool: the producer computes and saves
    (never looks up), the consumer loads (never saves) through a staging buffer of 8 slots, so
    its loads come in chunks of 4 blocks."""
    batch = prompts(seed=1)
    expected = reference.generate(batch, greedy(), use_tqdm=False)
    config = pool_config("local", request, role="kv_producer")
    producer = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    first = producer.generate(batch, greedy(), use_tqdm=False)
    assert token_ids(first) == token_ids(expected)
    produced = stats(producer)
    assert "pool_lookups" not in produced
    # Every full block of the prompts and outputs the producer computed.
    assert produced["pool_save_blocks"] == 2 * ((PROMPT_LEN + MAX_TOKENS - 1) // BLOCK)

    config = dict(config, kv_role="kv_consumer")
    extra = config["kv_connector_extra_config"] = dict(config["kv_connector_extra_config"])
    extra["staging_bytes"] = 8 * slot_stride(spec_of(producer))
    consumer = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    computed = count_computed_tokens(consumer)
    outputs = consumer.generate(batch, greedy(), use_tqdm=False)
    assert token_ids(outputs) == token_ids(expected)
    assert_same_logprobs(outputs, expected)
    for out in outputs:
        assert out.num_cached_tokens == FULL
        assert computed[out.request_id] == PROMPT_LEN - FULL + MAX_TOKENS - 1
    consumed = stats(consumer)
    assert consumed["pool_hit_blocks"] == consumed["pool_load_blocks"] == 2 * FULL // BLOCK
    assert consumed["pool_load_bytes"] == 2 * FULL // BLOCK * BLOCK_BYTES
    assert "pool_save_blocks" not in consumed and "pool_errors.save.dropped" not in consumed
    for llm in (producer, consumer):
        assert_all_blocks_back(llm)


LLM_IN_A_PROCESS = """
import json, sys
from sluice import LLM, SamplingParams
model, config, engine, batch = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), \\
    json.loads(sys.argv[4])
llm = LLM(model=model, kv_transfer_config=config, **engine)
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[5]), ignore_eos=True)
outputs = llm.generate(batch, params, use_tqdm=False)
connector = llm.llm_engine.engine_core.executor.worker.connector
assert connector.wait_for_pending_saves(20.0)
print(json.dumps([[o.outputs[0].token_ids, o.num_cached_tokens] for o in outputs]))
"""


def run_llm_process(model: str, config: dict, batch: list[dict]) -> list:
    result = subprocess.run([sys.executable, "-c", LLM_IN_A_PROCESS, model, json.dumps(config),
                             json.dumps(ENGINE), json.dumps(batch), str(MAX_TOKENS)],
                            capture_output=True, text=True, timeout=240,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["redis", "mooncake", "mooncake-dummy"])
def test_llm_in_another_process_loads_what_this_one_computed_and_stores_it_once(
        kind: str, qwen3_dir: str, reference: LLM, request: pytest.FixtureRequest) -> None:
    require(kind)
    batch = prompts(seed=2)
    expected = reference.generate(batch, greedy(), use_tqdm=False)
    config = pool_config(kind, request)
    llm = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    assert token_ids(llm.generate(batch, greedy(), use_tqdm=False)) == token_ids(expected)
    wait_for_saves(llm)
    backend = worker_half(llm).client.backend
    if kind == "mooncake-dummy":  # the staging buffer is the dummy's shared memory: no copy
        assert backend._bounce == 0
        assert backend._shared == {worker_half(llm).mover.host.data_ptr(): backend.buffer.nbytes}
    prefix = worker_half(llm).prefix
    num_keys = backend.count_keys(prefix)
    assert num_keys == 2 * ((PROMPT_LEN + MAX_TOKENS - 1) // BLOCK)

    # Another process, another engine: its prefix cache is empty, the pool has the prompts.
    other = run_llm_process(qwen3_dir, config, batch)
    assert [ids for ids, _ in other] == token_ids(expected)
    assert [cached for _, cached in other] == [FULL, FULL]
    # A producer (no lookups) computes the same prompts again: every key exists already,
    # so nothing is put and the pool holds each block once.
    producer = dict(config, kv_role="kv_producer")
    assert [ids for ids, _ in run_llm_process(qwen3_dir, producer, batch)] == token_ids(expected)
    assert backend.count_keys(prefix) == num_keys
    assert_all_blocks_back(llm)


def test_workers_in_processes_of_their_own_save_and_load(
        qwen3_dir: str, reference: LLM, request: pytest.FixtureRequest) -> None:
    """The mp executor: each engine's worker half (its client, its staging buffer) lives in a
    worker process; the plan's block hashes cross the process boundary in the step message."""
    require("redis")
    batch = prompts(seed=8, count=1)
    expected = reference.generate(batch, greedy(), use_tqdm=False)
    config = pool_config("redis", request)
    engine = dict(ENGINE, distributed_executor_backend="mp")
    first = LLM(model=qwen3_dir, kv_transfer_config=config, **engine)
    assert token_ids(first.generate(batch, greedy(), use_tqdm=False)) == token_ids(expected)
    counter = scheduler_half(first).client.backend
    deadline = time.monotonic() + 10
    while counter.count_keys(scheduler_half(first).prefix) < FULL // BLOCK:
        assert time.monotonic() < deadline, "the worker process's saves never landed"
        time.sleep(0.05)
    second = LLM(model=qwen3_dir, kv_transfer_config=config, **engine)
    outputs = second.generate(batch, greedy(), use_tqdm=False)
    assert token_ids(outputs) == token_ids(expected) and outputs[0].num_cached_tokens == FULL
    assert_same_logprobs(outputs, expected)
    for llm in (first, second):
        assert_all_blocks_back(llm)
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("kind", ["local", "redis", "mooncake", "mooncake-dummy"])
def test_a_block_gone_between_lookup_and_load_is_recomputed(
        kind: str, qwen3_dir: str, reference: LLM, request: pytest.FixtureRequest) -> None:
    """The pool loses block 3 of the prompt after the scheduler found it and before the worker
    reads it (evicted; for `local`, overwritten with the same payload in format 1, the crc32
    trailer of an older sluice): blocks 0-2 load, the rest is recomputed, the output is
    unchanged, and the old-format value is counted as such."""
    if kind != "local":
        require(kind)
    batch = prompts(seed=3, count=1)
    expected = reference.generate(batch, greedy(), use_tqdm=False)
    llm = LLM(model=qwen3_dir, kv_transfer_config=pool_config(kind, request), **ENGINE)
    llm.generate(batch, greedy(), use_tqdm=False)
    wait_for_saves(llm)
    assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    scheduler = scheduler_half(llm)
    backend = worker_half(llm).client.backend
    after_alloc = scheduler.update_state_after_alloc

    def lose_block_3(request_: Any, block_ids: list[int], num_external_tokens: int) -> None:
        assert num_external_tokens == FULL  # found at lookup
        key = scheduler.prefix + request_.block_hashes[3].hash_value.hex()
        if kind == "local":
            payload = backend.store.get(key)[:-TRAILER_SIZE]
            crc = zlib.crc32(payload, zlib.crc32(key.encode()))
            backend.store.set(key, payload + struct.pack("<II", crc, len(payload)))
        elif kind == "redis":
            assert backend._client.delete(key) == 1
        else:
            assert backend._store.remove(key, True) == 0  # force: the lookup took a lease
        after_alloc(request_, block_ids, num_external_tokens)

    scheduler.update_state_after_alloc = lose_block_3
    outputs = llm.generate(batch, greedy(), use_tqdm=False)
    assert token_ids(outputs) == token_ids(expected)
    assert_same_logprobs(outputs, expected)
    assert outputs[0].num_cached_tokens == 3 * BLOCK
    counters = stats(llm)
    assert counters["pool_errors.load.missing"] == 1
    assert counters.get("pool_errors.load.other_format") == (1 if kind == "local" else None)
    assert counters["pool_load_blocks"] == FULL // BLOCK - 1
    assert_all_blocks_back(llm)


def test_local_hits_the_pool_lost_are_saved_again(
        qwen3_dir: str, reference: LLM, request: pytest.FixtureRequest) -> None:
    """The pool loses an instance's blocks (evicted, or restarted empty) while the instance
    keeps them in its prefix cache: its next lookup of them sees that and saves them again,
    so another instance finds them."""
    require("redis")
    batch = prompts(seed=7, count=1)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    config = pool_config("redis", request)
    llm = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    llm.generate(batch, greedy(), use_tqdm=False)
    wait_for_saves(llm)
    client, prefix = worker_half(llm).client.backend._client, worker_half(llm).prefix
    num_keys = (PROMPT_LEN + MAX_TOKENS - 1) // BLOCK
    assert client.delete(*client.keys(prefix + "*")) == num_keys
    outputs = llm.generate(batch, greedy(), use_tqdm=False)
    assert outputs[0].num_cached_tokens == FULL  # from the local prefix cache
    wait_for_saves(llm)
    assert worker_half(llm).client.backend.count_keys(prefix) == num_keys
    assert stats(llm)["pool_missing_local_blocks"] == FULL // BLOCK
    other = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    outputs = other.generate(batch, greedy(), use_tqdm=False)
    assert token_ids(outputs) == expected and outputs[0].num_cached_tokens == FULL
    assert stats(other)["pool_load_blocks"] == FULL // BLOCK
    for engine in (llm, other):
        assert_all_blocks_back(engine)


@pytest.mark.parametrize(("kv_cache_dtype", "load_mode"),
                         [("auto", "async"), ("fp8", "async"), ("auto", "sync")])
def test_pool_with_chunked_prefill_and_preemption_keeps_greedy_output(
        qwen3_dir: str, reference: LLM, request: pytest.FixtureRequest,
        kv_cache_dtype: str, load_mode: str) -> None:
    """Also with an 8-bit cache, whose blocks the pool holds as bytes (against an fp8
    engine), and with loads inside the step (load_mode "sync")."""
    batch = prompts(seed=4, count=4)
    if kv_cache_dtype == "fp8":
        reference = LLM(model=qwen3_dir, kv_cache_dtype="fp8", **ENGINE)
    expected = token_ids(reference.generate(batch, greedy(16), use_tqdm=False))
    engine = dict(ENGINE, max_num_batched_tokens=64, num_gpu_blocks_override=13,
                  max_model_len=176, kv_cache_dtype=kv_cache_dtype)
    config = pool_config("local", request, load_mode=load_mode)
    llm = LLM(model=qwen3_dir, kv_transfer_config=config, **engine)
    # All four at once: chunked, and preempting for blocks (160 + 16 = max_model_len).
    for _ in range(2):
        assert token_ids(llm.generate(batch, greedy(16), use_tqdm=False)) == expected
        wait_for_saves(llm)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert stats(llm)["pool_load_blocks"] > 0
    assert_all_blocks_back(llm)


# ---- a pool that is not there, stalls, comes back ----


def test_pool_down_at_start_is_a_clear_error_naming_it(qwen3_dir: str) -> None:
    require("redis")
    port = servers.free_port()
    config = {"kv_connector": "KVPoolConnector", "kv_connector_extra_config": {
        "backend": "redis", "url": f"redis://127.0.0.1:{port}", "timeout_s": 1.0}}
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"redis pool at redis://127.0.0.1:{port} cannot be "
                                           f"used .*on_backend_error"):
        LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    assert time.monotonic() - start < 30  # (mostly loading the model)


def pool_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "KV pool at" in r.getMessage()]


def test_recompute_without_a_pool_at_start_then_use_it_once_it_is_up(
        qwen3_dir: str, reference: LLM, caplog: pytest.LogCaptureFixture) -> None:
    require("redis")
    port = servers.free_port()
    config = {"kv_connector": "KVPoolConnector", "kv_connector_extra_config": {
        "backend": "redis", "url": f"redis://127.0.0.1:{port}", "timeout_s": 1.0,
        "on_backend_error": "recompute", "retry_interval_s": 0.2, "staging_bytes": STAGING,
        "load_policy": "always"}}
    batch = prompts(seed=5, count=1)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    with caplog.at_level(logging.WARNING, logger="sluice"):
        llm = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
        for _ in range(3):
            assert token_ids(llm.generate(batch, greedy(), use_tqdm=False)) == expected
            llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    # Said once by each half (the scheduler's lookups, the worker's transfers), not per request.
    warnings = pool_warnings(caplog)
    assert len(warnings) == 2 and all("unreachable at start" in w for w in warnings), warnings
    assert f"127.0.0.1:{port}" in warnings[0]
    with servers.start_redis(port) as server:
        deadline = time.monotonic() + 10
        while worker_half(llm).client.backend is None or scheduler_half(llm).client.backend is None:
            assert time.monotonic() < deadline, "the connector never reached the pool"
            time.sleep(0.05)
        assert token_ids(llm.generate(batch, greedy(), use_tqdm=False)) == expected
        wait_for_saves(llm)
        assert worker_half(llm).client.backend.count_keys("") > 0
        assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
        outputs = llm.generate(batch, greedy(), use_tqdm=False)
        assert token_ids(outputs) == expected and outputs[0].num_cached_tokens == FULL
        assert_all_blocks_back(llm)
        llm.llm_engine.engine_core.shutdown()
        server.kill()


def test_stalled_pool_costs_each_lookup_its_bound_and_one_warning(
        qwen3_dir: str, reference: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """SIGSTOP of the Redis server: lookups are misses after lookup_timeout_s, saves time out
    in the background, requests complete with the right output; one warning per half for the
    whole outage; after SIGCONT the pool serves hits again."""
    require("redis")
    batch = prompts(seed=6, count=3)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    with servers.start_redis() as server:
        config = {"kv_connector": "KVPoolConnector", "kv_connector_extra_config": {
            "backend": "redis", "url": server.url, "timeout_s": 0.5, "lookup_timeout_s": 0.2,
            "retry_interval_s": 0.3, "staging_bytes": STAGING, "load_policy": "always"}}
        llm = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
        assert token_ids(llm.generate(batch[:1], greedy(), use_tqdm=False)) == expected[:1]
        wait_for_saves(llm)
        llm.llm_engine.kv_cache_manager.reset_prefix_cache()
        server.pause()
        try:
            with caplog.at_level(logging.WARNING, logger="sluice"):
                for i in range(3):  # the saved prompt and two new ones, one at a time
                    start = time.monotonic()
                    out = llm.generate(batch[i:i + 1], greedy(), use_tqdm=False)
                    assert token_ids(out) == expected[i:i + 1]
                    assert out[0].num_cached_tokens == 0
                    # One lookup (0.2 s) and a save in the background: far from a stall.
                    assert time.monotonic() - start < 3.0
                    llm.llm_engine.kv_cache_manager.reset_prefix_cache()
                wait_for_saves(llm)
            warnings = pool_warnings(caplog)
            assert sorted(w.split(" (")[0] for w in warnings) == [
                f"KV pool at {server.url} unreachable from the scheduler",
                f"KV pool at {server.url} unreachable from the worker"], warnings
            counters = scheduler_half(llm).get_stats()
            assert counters["pool_available"] == 0 and counters["pool_outages"] == 1
            assert counters["pool_errors.lookup.timeout"] >= 1
        finally:
            server.resume()
        deadline = time.monotonic() + 15
        while True:  # the next lookup after retry_interval_s finds the pool again
            out = llm.generate(batch[:1], greedy(), use_tqdm=False)
            assert token_ids(out) == expected[:1]
            if out[0].num_cached_tokens == FULL:
                break
            assert time.monotonic() < deadline, "the pool never served hits again"
            llm.llm_engine.kv_cache_manager.reset_prefix_cache()
            time.sleep(0.2)
        assert scheduler_half(llm).get_stats()["pool_available"] == 1
        assert_all_blocks_back(llm)
        llm.llm_engine.engine_core.shutdown()


def test_local_pool_refuses_workers_in_other_processes(qwen3_dir: str) -> None:
    config = {"kv_connector": "KVPoolConnector"}
    with pytest.raises(Exception, match="local pool backend lives in one process"):
        LLM(model=qwen3_dir, kv_transfer_config=config, distributed_executor_backend="mp",
            **ENGINE)



# ---- asynchronous loads (load_mode "async", the default) ----


def gate_loads(llm: LLM) -> Any:
    """Every load of `llm`'s worker waits, on its load thread, until the returned event is set
    (at most 20 s)."""
    import threading

    worker = worker_half(llm)
    gate, fetch = threading.Event(), worker._fetch

    def gated(*args: Any) -> Any:
        assert gate.wait(20.0), "the test never opened the gate"
        return fetch(*args)

    worker._fetch = gated
    return gate


def in_pool_not_in_cache(llm: LLM, batch: list[dict]) -> None:
    llm.generate(batch, greedy(), use_tqdm=False)
    wait_for_saves(llm)
    assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()


def test_a_hit_loads_while_the_others_decode_and_keeps_greedy_output(
        qwen3_dir: str, reference: LLM) -> None:
    """A pool hit whose load is held back waits in WAITING_FOR_REMOTE_KVS while a running
    request's tokens go on; once the load ends it computes only its last block, and both
    outputs equal the reference's."""
    hit, other = prompts(seed=30, count=1)[0], prompts(seed=31, count=1, length=40)[0]
    expected = token_ids(reference.generate([hit, other], greedy(16), use_tqdm=False))
    llm = LLM(model=qwen3_dir, kv_transfer_config=pool_config("local"), **ENGINE)
    in_pool_not_in_cache(llm, [hit])
    gate = gate_loads(llm)
    engine = llm.llm_engine
    computed = count_computed_tokens(llm)
    engine.add_request("other", other, greedy(16))
    engine.step()
    engine.add_request("hit", hit, greedy(16))
    tokens: dict[str, list[int]] = {"hit": [], "other": []}
    outputs = {}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        assert engine.scheduler.requests["hit"].status.name == "WAITING_FOR_REMOTE_KVS"
    assert len(tokens["other"]) >= 4 and not tokens["hit"]
    gate.set()
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert [outputs[r].outputs[0].token_ids for r in ("hit", "other")] == expected
    assert outputs["hit"].num_cached_tokens == FULL
    assert computed["hit"] == PROMPT_LEN - FULL + 16 - 1
    assert stats(llm)["pool_load_blocks"] == FULL // BLOCK
    assert_all_blocks_back(llm)
    engine.engine_core.shutdown()


def test_abort_mid_async_load_keeps_the_blocks_until_it_ends_then_frees_them(
        qwen3_dir: str) -> None:
    hit = prompts(seed=32, count=1)[0]
    llm = LLM(model=qwen3_dir, kv_transfer_config=pool_config("local"), **ENGINE)
    in_pool_not_in_cache(llm, [hit])
    gate = gate_loads(llm)
    engine = llm.llm_engine
    engine.add_request("doomed", hit, greedy())
    engine.step()
    assert engine.scheduler.requests["doomed"].status.name == "WAITING_FOR_REMOTE_KVS"
    manager = engine.kv_cache_manager
    engine.abort_request("doomed")
    engine.step()
    # The load may still write them: not free yet.
    assert manager.get_num_free_blocks() < manager.block_pool.num_blocks - 1
    gate.set()
    deadline = time.monotonic() + 10.0
    while manager.get_num_free_blocks() < manager.block_pool.num_blocks - 1:
        assert time.monotonic() < deadline, "the aborted load's blocks never came back"
        engine.step()
        time.sleep(0.01)
    assert_all_blocks_back(llm)
    engine.engine_core.shutdown()
