"""`sluice serve --api-server-count 2`: two API-server processes on one port and one engine
core, as users run it (a subprocess, the real openai client). Requests reach both API servers
and give the offline engine's greedy output, and /metrics from either counts both servers'
requests; a stream closed mid-way is aborted in the core;
SIGTERM drains both and every process exits; an API server killed stops the whole server with
status 1, and so does a killed engine core (streams in flight end with an error); a prefill and
a decode instance of two API servers each serve through the router as colocated; a count under
1 is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from sluice import LLM, SamplingParams
from sluice.process_utils import pid_alive
from tests.server.conftest import ServerProcess, launch_server
from tests.server.test_openai_server import wait_for_idle_engine
from tests.server.test_server_errors import StreamReader

pytestmark = pytest.mark.serial

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello, my name is",
           "The quick brown fox", "In the beginning", "def fibonacci(n):", "Water boils at"]


def launch(qwen3_dir: str, log_path: Path, *extra: str) -> ServerProcess:
    server = launch_server(qwen3_dir, log_path, "--api-server-count", "2", *extra)
    deadline = time.monotonic() + 60
    while server.log().count("API server") < 2 or "API server 1: serving" not in server.log():
        assert time.monotonic() < deadline, server.log()[-4000:]
        time.sleep(0.1)
    return server


def processes(server: ServerProcess, **headers: str) -> list[int]:
    """The engine core's and both API servers' pids (asked until both have answered)."""
    api_servers: dict[int, int] = {}
    for _ in range(200):
        info = server.engine_info(**headers)
        api_servers[info["api_server"]["index"]] = info["api_server"]["pid"]
        if len(api_servers) == 2:
            return [info["engine_core_pid"], *api_servers.values()]
    raise AssertionError(f"only API servers {sorted(api_servers)} answered")


def assert_all_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if pid_alive(pid)]
        time.sleep(0.1)


@pytest.fixture(scope="module")
def two_api_servers(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[ServerProcess]:
    server = launch(qwen3_dir, tmp_path_factory.mktemp("api-servers") / "server.log")
    yield server
    server.stop(10.0)


def test_requests_spread_over_both_api_servers_and_equal_the_offline_output(
        two_api_servers: ServerProcess, reference: LLM) -> None:
    server = two_api_servers
    assert len(set(processes(server))) == 3
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=60)

    def complete(i: int) -> str:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            stream = client.completions.create(model=server_model(server), prompt=prompt,
                                               max_tokens=12, temperature=0, stream=True)
            return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        return client.completions.create(model=server_model(server), prompt=prompt,
                                         max_tokens=12, temperature=0).choices[0].text

    # Each call its own connection (the openai client's pool is not shared across threads
    # here), so the kernel deals them out to both API servers.
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(complete, range(16)))
    offline = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12),
                                 use_tqdm=False)
    assert texts == [offline[i % len(PROMPTS)].outputs[0].text for i in range(16)]
    scheduler = wait_for_idle_engine(server)
    assert scheduler["num_free_blocks"] == scheduler["num_blocks"]
    assert server.engine_info()["integrity"] == "ok"
    # Whichever API server answers the scrape, it counts both servers' requests, and the
    # core's state once.
    want = {"sluice:request_success_total": 16,
            "sluice:prompt_tokens_total": sum(len(offline[i % 8].prompt_token_ids)
                                              for i in range(16)),
            "sluice:generation_tokens_total": sum(len(offline[i % 8].outputs[0].token_ids)
                                                  for i in range(16)),
            "sluice:num_requests_running": 0, "sluice:kv_cache_usage_perc": 0,
            "sluice:time_to_first_token_seconds_count": 16}
    deadline = time.monotonic() + 10  # until API server 0 has recorded the core's last state
    while metric_sums(server, want) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(6):
        assert metric_sums(server, want) == want


def metric_sums(server: ServerProcess, names: dict[str, float]) -> dict[str, float]:
    """Each named sample summed over its labels, from one scrape of /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums


def server_model(server: ServerProcess, **headers: str) -> str:
    return httpx.get(f"{server.base_url}/v1/models", headers=headers,
                     timeout=10).json()["data"][0]["id"]


def test_a_stream_closed_mid_way_is_aborted_in_the_shared_core(
        two_api_servers: ServerProcess) -> None:
    server = two_api_servers
    body = {"model": server_model(server), "prompt": "Keep going", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    for _ in range(4):  # on fresh connections: both API servers, most likely
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          timeout=60) as response:
            lines = response.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data: ")) == 3
    scheduler = wait_for_idle_engine(server)
    assert scheduler["num_running"] + scheduler["num_waiting"] == 0
    assert scheduler["num_free_blocks"] == scheduler["num_blocks"]
    assert server.engine_info()["integrity"] == "ok"


def test_sigterm_drains_both_api_servers_then_every_process_exits(
        two_api_servers: ServerProcess) -> None:
    """Last in this module: it stops the shared server."""
    server = two_api_servers
    pids = processes(server)
    body = {"model": server_model(server), "prompt": "Keep going", "max_tokens": 48,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        server.proc.send_signal(signal.SIGTERM)
        # A slow reader may get the rest of the tokens merged into the first event.
        events = [first, *(line for line in lines if line.startswith("data: "))]
    assert len(events) >= 2 and events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2] or '"finish_reason": "length"' in events[-2]
    assert server.proc.wait(60) == 0, server.log()[-4000:]
    assert_all_gone(pids)


def test_a_killed_api_server_stops_the_whole_server(qwen3_dir: str, tmp_path: Path) -> None:
    server = launch(qwen3_dir, tmp_path / "server.log")
    try:
        core, first, second = processes(server)
        subprocess.run(["kill", "-9", str(second)], check=True)
        assert server.proc.wait(30) == 1
        assert f"API server pid {second} exited" in server.log()
        assert_all_gone([core, first, second])
    finally:
        server.stop(5.0)


def test_a_killed_engine_core_ends_streams_with_an_error_and_stops_the_server(
        qwen3_dir: str, tmp_path: Path) -> None:
    """With an API key, which reaches the API servers outside their command lines."""
    server = launch(qwen3_dir, tmp_path / "server.log", "--api-key", "sesame")
    try:
        assert httpx.get(f"{server.base_url}/v1/models", timeout=10).status_code == 401
        core, first, second = processes(server, Authorization="Bearer sesame")
        for pid in (first, second):
            assert b"sesame" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        model = server_model(server, Authorization="Bearer sesame")
        readers = [StreamReader(server, api_key="sesame", model=model, prompt=f"Victim {i}",
                                max_tokens=1000, extra_body={"ignore_eos": True})
                   for i in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.first_chunk.wait(30)
        os.kill(core, signal.SIGKILL)
        killed_at = time.monotonic()
        for reader in readers:
            reader.join(10)
            assert isinstance(reader.error, openai.APIError), reader.error
            assert reader.ended_at - killed_at < 5.0
        assert server.proc.wait(30) == 1
        assert f"the engine core (pid {core}) exited" in server.log()
        assert_all_gone([core, first, second])
    finally:
        server.stop(5.0)


def test_api_server_count_under_one_is_refused() -> None:
    result = subprocess.run([sys.executable, "-m", "sluice", "serve", "--api-server-count",
                             "0", "--device", "cpu"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "api_server_count must be >= 1, got 0" in result.stderr


def test_prefill_and_decode_instances_of_two_api_servers_each_equal_colocated(
        qwen3_dir: str, server: ServerProcess, tmp_path: Path) -> None:
    """PD through the router with both instances running two API servers: a request's
    kv_transfer_params go out from whichever prefill API server answered and come in at
    whichever decode API server the router reached."""
    from sluice.testing.pd_cluster import start_cluster, wait_blocks_back
    from tests.server.test_disagg_serving import FLAGS, assert_same, calls, reference, run_calls

    two = ["--api-server-count", "2"]
    cluster = start_cluster(qwen3_dir, FLAGS, "fake", prefill_flags=two, decode_flags=two,
                            workdir=tmp_path)
    try:
        batch = calls(16, seed=3)
        want = reference(server, batch)
        for i, (got, expected) in enumerate(zip(run_calls(cluster.router.url, batch), want)):
            assert_same(got, expected, (i, batch[i]))
        for instance in [*cluster.prefills, *cluster.decodes]:
            assert wait_blocks_back(instance)["integrity"] == "ok"
        decode = cluster.decodes[0].engine_info()["scheduler"]["kv_connector"]
        assert decode["worker_rooms_received"] >= 16  # each request's KV came by transfer
    finally:
        cluster.stop()
