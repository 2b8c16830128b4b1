"""Two `sluice serve` processes on one pool, for each real backend (a real `redis-server`; a real
`mooncake_master` whose memory is a separate segment-owner process; a real `sluice pool-server`,
the shared host tier, alone and in front of the `redis-server`): instance B serves what
instance A computed from the pool, reports it cached, computes that many fewer tokens and keeps
the greedy output of an engine without the pool; a prompt sent to both is stored once; the
backend killed mid-run (the server, the master, the segment owner) costs no request its output
and no instance its health, and once it is back the pool serves hits again. After each test
every block of both instances is back and their KV caches pass their integrity checks."""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sluice import LLM, SamplingParams
from sluice.core.kv_connector import KVCacheSpec
from sluice.kv_transfer.pool import PoolBackend, PoolError, create_backend
from sluice.kv_transfer.pool.settings import key_prefix
from sluice.testing import servers
from tests.kv_transfer.conftest import require
from tests.server.conftest import ENGINE_KWARGS, ServerProcess, launch_server

pytestmark = pytest.mark.serial

BLOCK = ENGINE_KWARGS["block_size"]  # 8
PROMPT_LEN = 200
FULL = (PROMPT_LEN - 1) // BLOCK * BLOCK  # 192 tokens from the pool, 8 computed
MAX_TOKENS = 8
# Blocks a request saves: every full block of its prompt (save_decode_blocks is off).
SAVED_BLOCKS = PROMPT_LEN // BLOCK


@dataclass
class Pool:
    kind: str
    a: ServerProcess
    b: ServerProcess
    counter: PoolBackend  # this process's client, to count keys
    prefix: str  # the instances' keys (both rank 0 of the same model)
    victims: dict[str, servers.ServerProcess]  # what a test may kill: "server", "segment owner"


@pytest.fixture(scope="module")
def reference_llm(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, **ENGINE_KWARGS)


@pytest.fixture(scope="module", params=["redis", "mooncake", "shm", "tiered"])
def pool(request: pytest.FixtureRequest, qwen3_dir: str,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    kind = request.param
    require(kind)
    model_id = f"serve-{uuid.uuid4().hex[:8]}"
    extra = {"backend": kind, "model_id": model_id, "timeout_s": 2.0, "lookup_timeout_s": 0.5,
             "retry_interval_s": 0.5, "staging_bytes": 2 << 20, "load_policy": "always"}
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        victims = {"server": server}
        extra["url"] = server.url
        counter = create_backend(server.url, timeout_s=5.0)
    elif kind == "shm":
        server = request.getfixturevalue("shm_pool")
        victims = {"server": server}
        extra["url"] = server.url
        counter = create_backend(server.url, timeout_s=5.0)
    elif kind == "tiered":  # a tier's faults: test_pool_shm.py (the other tier answers)
        near, far = request.getfixturevalue("shm_pool"), request.getfixturevalue("redis_server")
        victims = {}
        extra.update(backend="shm", url=near.url, remote_url=far.url)
        counter = create_backend(near.url, remote_url=far.url, timeout_s=5.0)
    else:
        master = request.getfixturevalue("mooncake_master")
        owner = request.getfixturevalue("mooncake_segment_owner")
        victims = {"server": master, "segment owner": owner}
        extra.update(url=master.url, global_segment_size=0, admin_port=master.admin_port)
        counter = create_backend(master.url, timeout_s=5.0, global_segment_size=0,
                                 admin_port=master.admin_port)
    config = json.dumps({"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": extra})
    logs = tmp_path_factory.mktemp(f"pool-{kind}")
    instances = start_two(qwen3_dir, logs, "--served-model-name", "tiny",
                          "--kv-transfer-config", config)
    spec = KVCacheSpec("", "float32", BLOCK, 2, 16, ("l0", "l1"))
    try:
        yield Pool(kind, *instances, counter, key_prefix(spec, model_id), victims)
    finally:
        codes = [s.stop() for s in instances]
        counter.close()
    assert codes == [0, 0], [s.log()[-3000:] for s in instances]


def start_two(model_dir: str, logs: Path, *extra: str) -> tuple[ServerProcess, ServerProcess]:
    """Two servers started together (their start-ups overlap)."""
    started: list[ServerProcess] = []
    threads = [threading.Thread(target=lambda name=name: started.append(
        launch_server(model_dir, logs / f"{name}.log", *extra))) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(started) == 2, "a server did not start (see the log above)"
    started.sort(key=lambda s: s.log_path.name)
    return started[0], started[1]


def random_prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 400) for _ in range(length)]


def expected(reference_llm: LLM, prompt: list[int], max_tokens: int = MAX_TOKENS
             ) -> tuple[str, list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0)
    (out,) = reference_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    logprobs = [entry[token].logprob for entry, token in zip(out.outputs[0].logprobs,
                                                             out.outputs[0].token_ids)]
    return out.outputs[0].text, logprobs


def complete(server: ServerProcess, prompt: list[int], max_tokens: int = MAX_TOKENS
             ) -> tuple[str, list[float], int]:
    """(text, chosen tokens' logprobs, cached prompt tokens) of a greedy completion."""
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    return (choice["text"], choice["logprobs"]["token_logprobs"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"])


def assert_same(got: tuple[str, list[float], int], want: tuple[str, list[float]]) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


def engine_stats(server: ServerProcess) -> dict:
    return server.engine_info()["scheduler"]


def assert_blocks_back(*instances: ServerProcess) -> None:
    for server in instances:
        deadline = time.monotonic() + 10
        while True:
            info = server.engine_info()  # (the KV cache's integrity checked too)
            scheduler = info["scheduler"]
            if scheduler["num_free_blocks"] == scheduler["num_blocks"]:
                break
            assert time.monotonic() < deadline, f"blocks never came back: {scheduler}"
            time.sleep(0.1)
        assert info["integrity"] == "ok", info["integrity"]


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def wait_until_saves_land(pool: Pool, timeout_s: float = 60.0) -> None:
    """Until a prompt A computes is stored whole (after an earlier test's outage a backend may
    take a while to settle: a Mooncake client's first calls after the master is back can time
    out)."""
    deadline = time.monotonic() + timeout_s
    for attempt in range(1000):
        before = pool.counter.count_keys(pool.prefix)
        complete(pool.a, random_prompt(10_000 + len(pool.prefix) + attempt))
        try:
            wait_for_keys(pool, before + SAVED_BLOCKS, timeout_s=3.0)
            return
        except AssertionError:
            assert time.monotonic() < deadline, "saves never land in the pool"


def wait_for_keys(pool: Pool, count: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = pool.counter.count_keys(pool.prefix)
        except PoolError:
            found = -1
        if found == count:
            return
        assert time.monotonic() < deadline, (
            f"{found} keys in the pool, expected {count}; A: "
            f"{engine_stats(pool.a)['kv_connector']}")
        time.sleep(0.1)


def test_instance_b_serves_what_a_computed_and_both_store_a_prompt_once(
        pool: Pool, reference_llm: LLM) -> None:
    prompt = random_prompt(1)
    want = expected(reference_llm, prompt)
    keys_before = pool.counter.count_keys(pool.prefix)
    first = complete(pool.a, prompt)
    assert_same(first, want)
    assert first[2] == 0
    wait_for_keys(pool, keys_before + SAVED_BLOCKS)

    scheduled = engine_stats(pool.b)["num_scheduled_tokens_total"]
    hits_before = metric(pool.b, "sluice:kv_pool_hit_blocks_total")
    second = complete(pool.b, prompt)
    assert_same(second, want)
    assert second[2] == FULL  # usage.prompt_tokens_details.cached_tokens
    # B ran the prompt's last 8 tokens and one per output after the first, nothing more.
    stats = engine_stats(pool.b)
    assert stats["num_scheduled_tokens_total"] - scheduled == PROMPT_LEN - FULL + MAX_TOKENS - 1
    assert metric(pool.b, "sluice:kv_pool_hit_blocks_total") - hits_before == FULL // BLOCK
    assert metric(pool.b, "sluice:kv_pool_load_bytes_total") >= FULL // BLOCK * 4096
    assert metric(pool.b, "sluice:kv_pool_available") == 1
    assert stats["kv_connector"]["pool_load_blocks"] >= FULL // BLOCK

    # The same new prompt to both at once: both compute it (or, if one is quicker, the other
    # finds its blocks), and the pool keeps one copy of each block.
    keys_before = pool.counter.count_keys(pool.prefix)
    prompt = random_prompt(2)
    want = expected(reference_llm, prompt)
    results: dict[str, tuple] = {}
    threads = [threading.Thread(target=lambda s=s, n=n: results.update({n: complete(s, prompt)}))
               for n, s in (("a", pool.a), ("b", pool.b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in ("a", "b"):
        assert_same(results[name], want)
    assert results["a"][2] == 0 or results["b"][2] == 0
    wait_for_keys(pool, keys_before + SAVED_BLOCKS)
    time.sleep(1.0)  # the slower instance's saves are done too: still one copy of each block
    assert pool.counter.count_keys(pool.prefix) == keys_before + SAVED_BLOCKS
    assert_blocks_back(pool.a, pool.b)


def run_all(requests: list[tuple[ServerProcess, list[int], tuple]]
            ) -> tuple[list[threading.Thread], list]:
    """Send every request at once: the threads, and the list their completions (or
    exceptions) land in, in order."""
    results: list = [None] * len(requests)

    def send(i: int, server: ServerProcess, prompt: list[int]) -> None:
        try:
            results[i] = complete(server, prompt, max_tokens=16)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i, s, p))
               for i, (s, p, _) in enumerate(requests)]
    for thread in threads:
        thread.start()
    return threads, results


def pool_errors(server: ServerProcess) -> float:
    return sum(value for name, value in engine_stats(server)["kv_connector"].items()
               if name.startswith("pool_errors."))


@pytest.mark.parametrize("victim", ["server", "segment owner"])
def test_backend_killed_mid_run_costs_no_output_and_hits_come_back(
        pool: Pool, reference_llm: LLM, victim: str) -> None:
    """SIGKILL of the victim while B loads prompts A computed and A computes and saves new
    ones; then B asked for more of A's prompts while it is down (a dead Mooncake segment
    owner's keys still look present for a while: their loads fail and are recomputed)."""
    if victim not in pool.victims:
        pytest.skip(f"{pool.kind} has no {victim}")
    process = pool.victims[victim]
    seed = 10 if victim == "server" else 40
    stored = [random_prompt(seed + i) for i in range(5)]
    fresh = [random_prompt(seed + 10 + i) for i in range(3)]
    wants = {tuple(p): expected(reference_llm, p, 16) for p in stored + fresh}
    wait_until_saves_land(pool)
    keys_before = pool.counter.count_keys(pool.prefix)
    for prompt in stored:  # A computes and saves them; B will load them
        complete(pool.a, prompt, max_tokens=16)
    wait_for_keys(pool, keys_before + len(stored) * SAVED_BLOCKS)
    errors_before = pool_errors(pool.b)
    # In flight when the backend dies: B loading, A computing and saving.
    requests = [(pool.b, p, wants[tuple(p)]) for p in stored[:3]]
    requests += [(pool.a, p, wants[tuple(p)]) for p in fresh]
    threads, results = run_all(requests)
    time.sleep(0.05)
    try:
        process.kill()
        while any(thread.is_alive() for thread in threads):
            for server in (pool.a, pool.b):
                assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
            time.sleep(0.2)
        for (_, _, want), result in zip(requests, results):
            assert not isinstance(result, BaseException), result
            assert_same(result, want)
        # Later requests while it is down: recomputed, same output, in bounded time.
        for prompt in stored[3:]:
            start = time.monotonic()
            assert_same(complete(pool.b, prompt, max_tokens=16), wants[tuple(prompt)])
            assert time.monotonic() - start < 20
        for server in (pool.a, pool.b):
            assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        assert pool_errors(pool.b) > errors_before, "B never noticed the outage"
    finally:
        process.restart()
    # Back: new prompts computed by A are served from the pool by B again.
    deadline = time.monotonic() + 60
    for attempt in range(1000):
        prompt = random_prompt(seed * 100 + attempt)
        want = expected(reference_llm, prompt)
        assert_same(complete(pool.a, prompt), want)
        time.sleep(1.0)
        result = complete(pool.b, prompt)
        assert_same(result, want)
        if result[2] == FULL:
            break
        assert time.monotonic() < deadline, "the pool never served hits again"
    assert_blocks_back(pool.a, pool.b)
