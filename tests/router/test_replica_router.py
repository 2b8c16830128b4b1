"""The router over plain replicas as users run it: two `sluice serve` replicas of the tiny model
and `sluice router --worker ... --worker ...` processes on free loopback ports, driven by the
official `openai` client. Through the router a request reads as one sent straight to a replica;
each policy sends requests where it should (the workers' own counters say where they went); a
replica SIGKILLed mid-run costs no request that had not started streaming, ends the ones that
had with a clear error within a bound, gets no more traffic, and is re-admitted once restarted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.testing.instances import Instance
from sluice.testing.replica_cluster import ReplicaCluster, start_replicas
from sluice.testing.servers import free_port
from tests.server.conftest import ENGINE_FLAGS
from tests.server.test_disagg_serving import MODEL, assert_same, calls, run_calls

pytestmark = pytest.mark.serial

FLAGS = [*ENGINE_FLAGS, "--served-model-name", MODEL]
HEALTH = ["--health-check-interval", "0.5", "--health-failure-threshold", "2"]
# The longest a request may take after its replica is SIGKILLed: a retry (connect refused at
# once) and the answer on the other replica, on a busy 2-core machine.
KILL_BOUND_S = 30.0


@pytest.fixture(scope="module")
def replicas(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaCluster]:
    cluster = start_replicas(qwen3_dir, FLAGS, num_workers=2,
                             workdir=tmp_path_factory.mktemp("replicas"))
    yield cluster
    cluster.stop()


@pytest.fixture
def router(replicas: ReplicaCluster, request: pytest.FixtureRequest) -> Iterator[Instance]:
    """A fresh router over both replicas with the policy the test names (its counts start at
    zero), stopped after the test."""
    policy = getattr(request, "param", "round_robin")
    started = replicas.start_router(["--policy", policy, *HEALTH])
    yield started
    replicas.stop_router(started)


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples at `url`/metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)


def finished(replicas: ReplicaCluster) -> list[float]:
    """Requests each replica finished, by its own /metrics."""
    return [metric(w.url, "sluice:request_success_total") for w in replicas.workers]


def router_workers(router: Instance) -> list[dict[str, Any]]:
    return httpx.get(f"{router.url}/workers", timeout=10).json()["worker"]


def completion(url: str, prompt: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_through_the_router_equals_a_replica_streamed_or_not(
        replicas: ReplicaCluster, router: Instance) -> None:
    # Completions and chat, streamed (with include_usage) and not, logprobs on some: the
    # router's answers equal the first replica's, though round_robin sends half to the other.
    batch = calls(16, seed=11)
    want = run_calls(replicas.workers[0].url, batch)
    got = run_calls(router.url, batch, concurrency=8)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, (i, batch[i]))
    assert [w["num_requests"] for w in router_workers(router)] == [8, 8]
    assert metric(router.url, "sluice_router_retries_total") == 0


def test_n_usage_and_include_usage_pass_through_unchanged(
        replicas: ReplicaCluster, router: Instance) -> None:
    body = {"model": MODEL, "prompt": "Count the birds on the wire", "max_tokens": 6,
            "temperature": 0, "n": 2, "logprobs": 1, "ignore_eos": True}
    direct = httpx.post(f"{replicas.workers[0].url}/v1/completions", json=body, timeout=60).json()
    routed = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json()
    assert [c["text"] for c in routed["choices"]] == [c["text"] for c in direct["choices"]]
    assert [c["index"] for c in routed["choices"]] == [0, 1]
    # The usage of both choices, as the replica counts it (cached_tokens may differ: the
    # replica that answered may have had the prompt cached).
    assert routed["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == 12
    assert routed["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]

    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5,
        temperature=0, n=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_round_robin_alternates_between_the_replicas(
        replicas: ReplicaCluster, router: Instance) -> None:
    before = finished(replicas)
    for i in range(6):
        completion(router.url, f"Round {i} of the robin", max_tokens=2)
    after = finished(replicas)
    assert [a - b for a, b in zip(after, before)] == [3, 3]
    assert [w["num_requests"] for w in router_workers(router)] == [3, 3]


@pytest.mark.parametrize("router", ["least_loaded"], indirect=True)
def test_least_loaded_sends_new_requests_to_the_idle_replica(
        replicas: ReplicaCluster, router: Instance) -> None:
    # One long request in flight on a replica: every short one sent meanwhile goes to the other.
    async def scenario() -> list[int]:
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as client:
            long = asyncio.ensure_future(client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Tell me everything", "max_tokens": 900,
                "ignore_eos": True, "temperature": 0}))
            deadline = time.monotonic() + 30
            while not any(w["in_flight"] for w in await asyncio.to_thread(router_workers,
                                                                          router)):
                assert time.monotonic() < deadline, "the long request never started"
                await asyncio.sleep(0.01)
            busy = [w["in_flight"] for w in router_workers(router)].index(1)
            before = finished(replicas)
            for i in range(4):
                response = await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": f"Short {i}", "max_tokens": 1, "temperature": 0})
                assert response.status_code == 200
            after = finished(replicas)
            still = router_workers(router)[busy]["in_flight"]
            assert still == 1, "the long request ended before the short ones: not a test"
            assert (await long).status_code == 200
            return [busy, *(int(a - b) for a, b in zip(after, before))]

    busy, *delta = asyncio.run(scenario())
    assert delta[busy] == 0 and delta[1 - busy] == 4


@pytest.mark.parametrize("router", ["cache_aware"], indirect=True)
def test_cache_aware_keeps_a_prefix_on_one_replica_and_spreads_distinct_ones(
        replicas: ReplicaCluster, router: Instance) -> None:
    prefixes = [f"System prompt {name}: " + " ".join(f"{name}{i}" for i in range(80))
                for name in ("alpha", "beta")]
    before = finished(replicas)
    cached = {p: [] for p in prefixes}
    for turn in range(3):
        for prefix in prefixes:
            usage = completion(router.url, f"{prefix} question {turn}?", max_tokens=2)["usage"]
            cached[prefix].append(usage["prompt_tokens_details"]["cached_tokens"])
    delta = [a - b for a, b in zip(finished(replicas), before)]
    # Each prefix stays where it was first computed: every repeat is a prefix-cache hit of
    # most of the prompt (its full blocks, 8 tokens each)...
    for prefix, hits in cached.items():
        assert hits[0] == 0, (prefix, hits)
        assert all(h >= 80 for h in hits[1:]), (prefix, hits)
    # ...and the two prefixes went to different replicas (the least loaded, in turn).
    assert delta == [3, 3]


def test_a_4xx_from_the_replica_passes_through_unchanged(
        replicas: ReplicaCluster, router: Instance) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": -1}
    direct = httpx.post(f"{replicas.workers[0].url}/v1/completions", json=body, timeout=30)
    for stream in (False, True):
        routed = httpx.post(f"{router.url}/v1/completions", json={**body, "stream": stream},
                            timeout=30)
        assert routed.status_code == direct.status_code == 400
        assert routed.json() == direct.json()
        assert routed.json()["error"]["param"] == "max_tokens"
    assert metric(router.url, "sluice_router_retries_total") == 0


def test_no_healthy_replica_is_a_503_with_an_openai_body(replicas: ReplicaCluster) -> None:
    nowhere = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    from sluice.testing.instances import start_router

    router = start_router([w for url in nowhere for w in ("--worker", url)], replicas.workdir,
                          [*HEALTH, "--max-retries", "2"], name="router-nowhere",
                          ready_unhealthy=True)
    try:
        assert httpx.get(f"{router.url}/health").status_code == 503
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        started = time.monotonic()
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as error:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=stream)
            assert error.value.status_code == 503
            body = error.value.response.json()["error"]
            assert body["type"] == "ServiceUnavailableError" and body["code"] == 503
            assert "failed on every attempt (3)" in body["message"]
            assert "no healthy worker instance" in body["message"]
        assert time.monotonic() - started < 10  # the backoff, not a hang
        models = httpx.get(f"{router.url}/v1/models")
        assert models.status_code == 503 and "no healthy worker" in models.json()["error"][
            "message"]
    finally:
        router.stop()


def test_sigkill_of_a_replica_mid_run_retries_what_had_not_streamed(
        replicas: ReplicaCluster, router: Instance) -> None:
    survivor, dying = replicas.workers
    # Streamed and not (round robin spreads both kinds over the replicas), the streams long
    # enough to be under way when the kill comes.
    batch = [replace(c, stream=i % 4 in (1, 2), max_tokens=300 if i % 4 in (1, 2) else 60)
             for i, c in enumerate(calls(16, seed=7))]
    want = run_calls(survivor.url, batch)
    generated = metric(dying.url, "sluice:generation_tokens_total")

    def ready_to_kill() -> bool:
        # Several requests on it, tokens generated there for them, and a stream committed.
        worker = router_workers(router)[1]
        return (worker["in_flight"] >= 3 and worker["streaming"] >= 1
                and metric(dying.url, "sluice:generation_tokens_total") >= generated + 16)

    async def scenario() -> list[Any]:
        results = asyncio.ensure_future(asyncio.to_thread(
            run_calls, router.url, batch, 16, 90.0))
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(ready_to_kill):
            assert time.monotonic() < deadline, "the replica never had requests under way"
            assert not results.done(), "the batch ended before the kill"
            await asyncio.sleep(0.01)
        dying.kill()  # the server and its engine core, at once
        killed_at = time.monotonic()
        got = await results
        return [got, time.monotonic() - killed_at]

    got, after_kill_s = asyncio.run(scenario())
    assert after_kill_s < KILL_BOUND_S
    errors = []
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, openai.APIError):
            # Only a stream that had sent tokens may fail, with the router's clear message (or
            # the replica's own error event, when its engine core died a moment before it).
            assert batch[i].stream, (i, g)
            assert ("failed mid-stream" in str(g) and dying.url in str(g)
                    or "the engine died during request" in str(g)), g
            errors.append(i)
        else:
            assert_same(g, w, (i, batch[i]))
    retries = metric(router.url, "sluice_router_retries_total")
    # Its committed streams ended with the error; whatever else it had went to the survivor.
    assert errors and retries + len(errors) >= 3
    print(f"SIGKILL of a replica with 16 requests in flight: {retries:g} retried, "
          f"{len(errors)} committed streams ended with an error, all done "
          f"{after_kill_s:.1f} s after the kill")

    # The router stopped sending to the dead replica...
    deadline = time.monotonic() + 5
    while router_workers(router)[1]["healthy"]:
        assert time.monotonic() < deadline, "the dead replica was never dropped"
        time.sleep(0.1)
    sent = router_workers(router)[1]["num_requests"]
    again = run_calls(router.url, calls(6, seed=9))
    assert all(isinstance(g, dict) for g in again), again
    assert router_workers(router)[1]["num_requests"] == sent
    assert httpx.get(f"{router.url}/health").status_code == 200  # one replica is enough

    # ...and re-admits it once it is back on its port (the next health check, 0.5 s apart).
    dying.restart()
    restarted_at = time.monotonic()
    while not router_workers(router)[1]["healthy"]:
        assert time.monotonic() - restarted_at < 5, "the restarted replica was not re-admitted"
        time.sleep(0.1)
    before = finished(replicas)
    for i in range(4):
        completion(router.url, f"Back again {i}", max_tokens=2)
    assert [a - b for a, b in zip(finished(replicas), before)] == [2, 2]
