"""Prefill/decode disaggregation as users run it: `sluice serve --disaggregation-mode prefill`
and `... decode` instances and a `sluice router`, each its own process on free loopback ports,
driven by the official `openai` client. Outputs equal the colocated `sluice serve` (the session's
`server`), and no fault (a killed prefill, aborts in every phase, random transfer failures, a
page-size mismatch) hangs a request or leaks a block: after every test, every instance's
/debug/engine shows its KV cache intact and every block free.

One 1P1D trio per backend (fake, and Mooncake Transfer Engine over TCP; the prefill's prompts
in chunks of 16 tokens, each chunk's layers sent as they are stored: layer-wise, the default)
serves most checks; a 2P1D trio with injected faults serves the failure and kill tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sluice.testing.instances import Instance, serve_argv, start_instances
from sluice.testing.pd_cluster import PDCluster, start_cluster, start_router, wait_blocks_back
from sluice.testing.servers import free_port
from tests.kv_transfer.test_disagg_transfer import require_backend
from tests.server.conftest import ENGINE_FLAGS, ServerProcess

pytestmark = pytest.mark.serial

MODEL = "tiny"
FLAGS = [*ENGINE_FLAGS, "--served-model-name", MODEL]
PREFILL_CHUNKS = ["--max-num-batched-tokens", "16"]  # most prompts in several steps


@dataclass(frozen=True)
class Call:
    kind: str  # "cmpl" | "chat"
    stream: bool
    prompt: str
    max_tokens: int
    logprobs: bool = False


def calls(count: int, seed: int = 0) -> list[Call]:
    """Completions and chat, streamed and not, prompts of many lengths (some past several KV
    blocks, some sharing a prefix), 1 to 24 tokens, logprobs on some."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    out = []
    for i in range(count):
        n = 2 + (i * 7 + seed) % 40
        prompt = f"Request {i % 5}: " + " ".join(words[(i + j) % len(words)] for j in range(n))
        out.append(Call(kind="chat" if i % 4 >= 2 else "cmpl", stream=i % 2 == 1,
                        prompt=prompt, max_tokens=1 + (i * 5) % 24, logprobs=i % 3 == 0))
    return out


async def call(client: openai.AsyncOpenAI, c: Call) -> dict[str, Any]:
    """The request's text, finish reason, usage and logprobs, however it was delivered."""
    result: dict[str, Any] = {"text": "", "logprobs": []}
    common: dict[str, Any] = dict(model=MODEL, max_tokens=c.max_tokens, temperature=0)
    if c.stream:
        common.update(stream=True, stream_options={"include_usage": True})
    if c.kind == "cmpl":
        if c.logprobs:
            common["logprobs"] = 2
        response = await client.completions.create(prompt=c.prompt, **common)
    else:
        if c.logprobs:
            common.update(logprobs=True, top_logprobs=2)
        response = await client.chat.completions.create(
            messages=[{"role": "user", "content": c.prompt}], **common)
    chunks = [chunk async for chunk in response] if c.stream else [response]
    for chunk in chunks:
        if chunk.usage is not None:
            result["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens,
                               chunk.usage.total_tokens)
            result["cached_tokens"] = chunk.usage.prompt_tokens_details.cached_tokens
        for choice in chunk.choices:
            if c.kind == "cmpl":
                result["text"] += choice.text
                if choice.logprobs is not None:
                    result["logprobs"] += choice.logprobs.token_logprobs
            else:
                part = choice.delta if c.stream else choice.message
                result["text"] += part.content or ""
                if choice.logprobs is not None and choice.logprobs.content:
                    result["logprobs"] += [p.logprob for p in choice.logprobs.content]
            if choice.finish_reason is not None:
                result["finish_reason"] = choice.finish_reason
    return result


def run_calls(url: str, batch: list[Call], concurrency: int = 32, timeout_s: float = 120.0
              ) -> list[dict[str, Any] | BaseException]:
    """Every call at once (at most `concurrency` in flight), each bounded by `timeout_s`."""

    async def main() -> list[dict[str, Any] | BaseException]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                    timeout=timeout_s)
        gate = asyncio.Semaphore(concurrency)

        async def one(c: Call) -> dict[str, Any]:
            async with gate:
                return await asyncio.wait_for(call(client, c), timeout_s)

        try:
            return await asyncio.gather(*(one(c) for c in batch), return_exceptions=True)
        finally:
            await client.close()

    return asyncio.run(main())


def assert_same(got: dict[str, Any], want: dict[str, Any], what: object) -> None:
    assert isinstance(got, dict), f"{what}: {got!r}"
    assert got["text"] == want["text"], what
    assert got["finish_reason"] == want["finish_reason"], what
    assert got["usage"] == want["usage"], what
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4), what


_reference_cache: dict[Call, dict[str, Any]] = {}


def reference(server: ServerProcess, batch: list[Call]) -> list[dict[str, Any]]:
    """The colocated server's answers (each distinct call asked once)."""
    missing = list(dict.fromkeys(c for c in batch if c not in _reference_cache))
    for c, result in zip(missing, run_calls(server.base_url, missing)):
        assert isinstance(result, dict), result
        _reference_cache[c] = result
    return [_reference_cache[c] for c in batch]


def connector_stats(instance: Instance) -> dict[str, float]:
    return instance.engine_info()["scheduler"]["kv_connector"]


def assert_layerwise(prefill: Instance) -> None:
    """The prefill sent every block layer by layer inside its prompts' steps: the bootstrap
    queue held each request until its decode had asked (the router sends both halves at
    once), so no room's write at the end had a block left to send."""
    stats = connector_stats(prefill)
    assert stats.get("bootstrap_held", 0) >= stats["send_rooms"] > 0, stats
    assert stats.get("bootstrap_wait_expired", 0) == 0, stats
    assert stats.get("worker_layer_writes", 0) > 0, stats
    assert stats.get("worker_streamed_blocks", 0) > 0, stats
    assert stats.get("worker_sent_blocks", 0) == 0, stats
    assert stats.get("worker_layer_write_errors", 0) == 0, stats


def router_metric(router: Instance, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{router.url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total += sample.value
    return total


@contextlib.contextmanager
def transfers_held(hold_file: Path) -> Iterator[None]:
    """Inside, a prefill started with SLUICE_PD_FAULT_SEND_HOLD_FILE=hold_file writes no room's
    KV (its rooms stay Transferring; an aborted one still ends at once): a test acts while
    transfers are under way, however busy the machine, with no race against a delay."""
    hold_file.touch()
    try:
        yield
    finally:
        hold_file.unlink(missing_ok=True)


def assert_blocks_back(cluster: PDCluster, timeout_s: float = 20.0) -> None:
    for instance in [*cluster.prefills, *cluster.decodes]:
        if instance.alive():
            wait_blocks_back(instance, timeout_s)


# ---- 1 prefill + 1 decode, per backend ---------------------------------------------------


@pytest.fixture(scope="module", params=["fake", "mooncake"])
def pd(request: pytest.FixtureRequest, qwen3_dir: str,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    backend = request.param
    require_backend(backend)
    # The fake trio's prefill holds its writes while a test asks (transfers_held), so the test
    # can act while a transfer is under way.
    workdir = tmp_path_factory.mktemp(f"pd-{backend}")
    hold_file = workdir / "hold-transfers"
    env = [{"SLUICE_PD_FAULT_SEND_HOLD_FILE": str(hold_file)}] if backend == "fake" else None
    cluster = start_cluster(qwen3_dir, FLAGS, backend, prefill_env=env, workdir=workdir,
                            prefill_flags=PREFILL_CHUNKS)
    cluster.backend = backend  # type: ignore[attr-defined]
    cluster.hold_file = hold_file  # type: ignore[attr-defined]
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def every_block_back(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("pd", "pd2"):
        if name in request.fixturenames:
            assert_blocks_back(request.getfixturevalue(name))


def only_fake(cluster: PDCluster) -> None:
    if cluster.backend != "fake":  # type: ignore[attr-defined]
        pytest.skip("checked once, on the fake backend")


def test_32_concurrent_requests_through_the_router_equal_colocated(
        pd: PDCluster, server: ServerProcess) -> None:
    batch = calls(32)
    want = reference(server, batch)
    started = time.monotonic()
    got = run_calls(pd.router.url, batch)
    elapsed = time.monotonic() - started
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, (i, batch[i]))
    stats = connector_stats(pd.decodes[0])
    assert stats["worker_rooms_received"] >= 32
    assert router_metric(pd.router, "sluice_router_retries_total") == 0
    assert_layerwise(pd.prefills[0])
    print(f"32 PD requests over {pd.backend}: {elapsed:.1f} s")  # type: ignore[attr-defined]


def test_decode_reuses_its_prefix_cache_and_receives_only_the_missing_blocks(
        pd: PDCluster, server: ServerProcess) -> None:
    only_fake(pd)
    base = "Shared prefix " + " ".join(f"w{i}" for i in range(60))
    first, second = (Call("cmpl", False, base, 4), Call("cmpl", False, base + " and more", 4))
    want = reference(server, [first, second])
    decode, prefill = pd.decodes[0], pd.prefills[0]
    got_first = run_calls(pd.router.url, [first])[0]
    before = connector_stats(decode)
    got_second = run_calls(pd.router.url, [second])[0]
    after = connector_stats(decode)
    assert_same(got_first, want[0], first)
    assert_same(got_second, want[1], second)
    num_prompt_tokens = got_second["usage"][0]
    blocks = -(-num_prompt_tokens // 8)
    reused = after["local_hit_blocks"] - before["local_hit_blocks"]
    received = after["worker_received_blocks"] - before["worker_received_blocks"]
    assert reused >= 8  # the first prompt's full blocks, from the decode's own cache
    assert reused + received == blocks
    # cached_tokens in usage: the prompt tokens the prefill did not compute.
    assert got_second["cached_tokens"] >= 8 * 8
    assert prefill.engine_info()["scheduler"]["prefix_cache_hits"] >= got_second["cached_tokens"]


async def _cancel_when(make_request: Any, ready: Any, timeout_s: float = 20.0) -> None:
    """Start a request, cancel it (the client goes away) once `ready()` says so."""
    task = asyncio.ensure_future(make_request())
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(ready):
        assert not task.done(), f"the request ended before the moment came: {task.result()}"
        assert time.monotonic() < deadline, "the moment to cancel never came"
        await asyncio.sleep(0.02)
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, httpx.HTTPError):
        pass


def test_client_disconnects_during_bootstrap_transfer_and_decode_leak_no_block(
        pd: PDCluster) -> None:
    only_fake(pd)
    prefill, decode, router = pd.prefills[0], pd.decodes[0], pd.router
    body = {"model": MODEL, "prompt": "Tell me a long story " * 8, "max_tokens": 300,
            "temperature": 0, "ignore_eos": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            # Bootstrap: the decode looks for a prefill that is not there (straight to the
            # decode, as a router would send it); its room waits in Bootstrapping.
            before = connector_stats(decode)
            nowhere = {"do_remote_prefill": True, "bootstrap_host": "127.0.0.1",
                       "bootstrap_port": free_port(), "bootstrap_room": 12345}
            await _cancel_when(
                lambda: client.post(f"{decode.url}/v1/completions",
                                    json={**body, "kv_transfer_params": nowhere}),
                lambda: connector_stats(decode).get("recv_rooms", 0) > before.get("recv_rooms", 0))
            started = time.monotonic()
            wait_blocks_back(decode, timeout_s=5)
            # Freed by the abort, well before the heartbeat or the bootstrap timeout would.
            assert time.monotonic() - started < 3

            # Transfer: the prefill is done and its write is held (the fault injection); the
            # abort ends the held room.
            before = connector_stats(prefill)
            with transfers_held(pd.hold_file):  # type: ignore[attr-defined]
                await _cancel_when(
                    lambda: client.post(f"{router.url}/v1/completions",
                                        json={**body, "stream": True}),
                    lambda: (connector_stats(prefill).get("send_rooms", 0)
                            > before.get("send_rooms", 0)))
                wait_blocks_back(prefill)
                wait_blocks_back(decode)
            after = connector_stats(prefill)
            assert after["worker_rooms_failed"] == before.get("worker_rooms_failed", 0) + 1

            # Decode: a few tokens streamed, then the client goes.
            async with client.stream("POST", f"{router.url}/v1/completions",
                                     json={**body, "stream": True}) as response:
                assert response.status_code == 200
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data:")
                    if seen == 3:
                        break
            wait_blocks_back(decode)

    asyncio.run(scenario())


def test_page_size_mismatch_is_refused_with_a_clear_message(
        pd: PDCluster, qwen3_dir: str) -> None:
    only_fake(pd)
    port = free_port()
    odd = Instance("decode-bs16", serve_argv(qwen3_dir, port, *FLAGS, "--block-size", "16",
                                             "--disaggregation-mode", "decode",
                                             "--disaggregation-transfer-backend", "fake"),
                   port, pd.workdir)
    start_instances([odd])
    router = None
    try:
        router = start_router(pd.prefills, [odd], pd.workdir, ["--max-retries", "1"],
                              name="router-bs16")
        response = httpx.post(f"{router.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert "page size mismatch" in message
        assert "has block size 8, this decode instance 16" in message
        assert "--block-size" in message
        wait_blocks_back(odd)
    finally:
        if router is not None:
            router.stop()
        odd.stop()


# ---- 2 prefills + 1 decode, with faults --------------------------------------------------

HEARTBEAT = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 2, "heartbeat_timeout_s": 0.5,
             "waiting_timeout_s": 20.0, "bootstrap_timeout_s": 20.0}


@pytest.fixture(scope="module")
def pd2(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    """Two prefills that fail 5% of their transfers (the first also holds its writes while a
    test asks, transfers_held), one decode with a 0.5 s heartbeat, a router that retries up to
    5 times."""
    faulty = {"SLUICE_PD_FAULT_TRANSFER_FAIL_PROB": "0.05"}
    workdir = tmp_path_factory.mktemp("pd2")
    hold_file = workdir / "hold-transfers"
    cluster = start_cluster(
        qwen3_dir, FLAGS, "fake", num_prefills=2,
        prefill_env=[{**faulty, "SLUICE_PD_FAULT_SEND_HOLD_FILE": str(hold_file)}, faulty],
        prefill_extra={"send_lease_s": 30.0}, decode_extra=HEARTBEAT,
        router_flags=["--health-check-interval", "0.5", "--health-failure-threshold", "2",
                      "--max-retries", "5", "--prefill-policy", "least_loaded",
                      "--decode-policy", "cache_aware"],
        workdir=workdir)
    cluster.hold_file = hold_file  # type: ignore[attr-defined]
    yield cluster
    cluster.stop()


def heartbeat_bound_s() -> float:
    return (HEARTBEAT["heartbeat_misses"] + 1) * HEARTBEAT["heartbeat_interval_s"] + \
        HEARTBEAT["heartbeat_timeout_s"]


def test_random_transfer_failures_end_in_correct_output_or_a_clean_error(
        pd2: PDCluster, server: ServerProcess) -> None:
    distinct = calls(20, seed=3)
    batch = [replace(distinct[i % 20], stream=(i // 20) % 2 == 1) for i in range(200)]
    want = reference(server, batch)
    started = time.monotonic()
    got = run_calls(pd2.router.url, batch, concurrency=16, timeout_s=60)
    elapsed = time.monotonic() - started
    errors = []
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, openai.APIStatusError):
            assert g.status_code == 503 and "failed on every attempt" in str(g), g
            errors.append(g)
        else:
            assert_same(g, w, (i, batch[i]))
    retries = router_metric(pd2.router, "sluice_router_retries_total")
    assert retries > 0  # 5% of 200+ transfers failed, and were retried
    assert len(errors) <= 2  # six failures in a row on one request: practically never
    for instance in pd2.instances:
        assert httpx.get(f"{instance.url}/health").status_code == 200
    print(f"200 requests, 5% transfer failures: {retries:g} retries, {len(errors)} errors, "
          f"{elapsed:.1f} s")


def kill_a_prefill_mid_transfer(pd: PDCluster, dying: Instance, batch: list[Call],
                                concurrency: int, lost_within_s: float,
                                before_kill: Any = None) -> tuple[list[Any], dict[str, float]]:
    """`batch` through the router with the prefills' transfers held; once two rooms pend on
    `dying`, `before_kill()` (if given) and SIGKILL it (the server, its engine core and its
    bootstrap server, at once). The decode must give up the lost rooms (their blocks freed)
    within `lost_within_s`, while the router retries their requests on the other prefill.
    Returns the batch's results and the decode's connector stats from before."""
    decode, router = pd.decodes[0], pd.router
    before = connector_stats(decode)

    def pending_on_dying() -> bool:
        stats = connector_stats(dying)
        done = stats.get("worker_rooms_sent", 0) + stats.get("worker_rooms_failed", 0)
        return stats.get("send_rooms", 0) - done >= 2

    def prefills_lost() -> float:
        return connector_stats(decode).get("worker_prefills_lost", 0)

    async def scenario() -> list[Any]:
        results = asyncio.ensure_future(asyncio.to_thread(
            run_calls, router.url, batch, concurrency, 90.0))
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(pending_on_dying):
            assert time.monotonic() < deadline, "no room was ever pending on the prefill"
            await asyncio.sleep(0.02)
        if before_kill is not None:
            before_kill()
        dying.kill()
        lost_before = before.get("worker_prefills_lost", 0)
        deadline = time.monotonic() + lost_within_s
        while await asyncio.to_thread(prefills_lost) <= lost_before:
            assert time.monotonic() < deadline, "the lost rooms outlived the heartbeat bound"
            await asyncio.sleep(0.05)
        return await results

    with transfers_held(pd.hold_file):  # type: ignore[attr-defined]
        return asyncio.run(scenario()), before


def test_sigkill_of_a_prefill_mid_flight_loses_no_request(
        pd2: PDCluster, server: ServerProcess) -> None:
    dying, survivor = pd2.prefills
    decode, router = pd2.decodes[0], pd2.router
    batch = [replace(c, max_tokens=24 + i % 8) for i, c in enumerate(calls(24, seed=5))]
    want = reference(server, batch)
    got, before = kill_a_prefill_mid_transfer(pd2, dying, batch, 24, heartbeat_bound_s() + 5)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, (i, batch[i]))
    wait_blocks_back(decode, timeout_s=heartbeat_bound_s() + 5)
    after = connector_stats(decode)
    assert after.get("worker_prefills_lost", 0) > before.get("worker_prefills_lost", 0)
    # The router dropped the dead prefill and sends nothing more its way.
    workers = httpx.get(f"{router.url}/workers").json()["prefill"]
    assert [w["healthy"] for w in workers] == [False, True]
    again = run_calls(router.url, calls(8, seed=9))
    assert all(isinstance(g, dict) for g in again), again
    after = httpx.get(f"{router.url}/workers").json()["prefill"]
    assert after[0]["num_requests"] == workers[0]["num_requests"]  # none to the dead one
    assert after[1]["num_requests"] >= workers[1]["num_requests"] + 8
    assert httpx.get(f"{router.url}/health").status_code == 200
