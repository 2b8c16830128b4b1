"""`sluice bench serve` against a real `sluice serve` on loopback, both as subprocesses, as a user
runs them: the printed block and the saved JSON hold the run's true counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.testing.instances import ServerError, launch_serve

pytestmark = pytest.mark.one_worker

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 32, 8


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    try:
        started = launch_serve(qwen3_dir, log_path)
    except ServerError as e:
        pytest.fail(f"sluice serve did not start: {e}")
    try:
        yield started.url
    finally:
        started.stop()


def run_bench(base_url: str, result_file: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "sluice", "bench", "serve", "--base-url", base_url,
            "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN), "--disable-tqdm", "--save-result",
            "--result-dir", str(result_file.parent), "--result-filename", result_file.name,
            *extra]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def read_results(path: Path) -> dict:
    """The results of the record `--save-result` wrote: vLLM's keys, and the client's CPU."""
    record = json.loads(path.read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == "serve"
    assert record["command"][:3] == ["sluice", "bench", "serve"]
    return record["results"]


def check_result(stdout: str, result: dict) -> None:
    lines = stdout.splitlines()
    start = lines.index("============ Serving Benchmark Result ============")
    block = lines[start:lines.index("=" * 50, start) + 1]
    assert f"{'Successful requests:':<40} {NUM_PROMPTS:<10}" in block
    assert f"{'Failed requests:':<40} {0:<10}" in block
    assert f"{'Total generated tokens:':<40} {NUM_PROMPTS * OUTPUT_LEN:<10}" in block
    for header in ("---------------Time to First Token----------------",
                   "-----Time per Output Token (excl. 1st token)------",
                   "---------------Inter-token Latency----------------"):
        assert header in block
    assert lines[-1].startswith("results saved to ")
    assert lines[0].startswith("sluice bench serve ") and lines[1].startswith("machine: ")

    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0)
    # ignore_eos is on for random prompts: every request runs to max_tokens.
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_input_tokens"] == sum(result["input_lens"]) > 0
    assert result["errors"] == [""] * NUM_PROMPTS
    assert all(t > 0 for t in result["ttfts"])
    assert all(1 <= len(itl) + 1 <= OUTPUT_LEN for itl in result["itls"])
    assert all(lat >= ttft for lat, ttft in zip(result["latencies"], result["ttfts"]))
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["mean_tpot_ms"] > 0
    # On a loaded box a request's tokens may all arrive in one chunk (no ITL); the P99 ITL is
    # positive whenever any request has one.
    if any(result["itls"]):
        assert result["p99_itl_ms"] > 0
    else:
        assert result["p99_itl_ms"] == 0
    assert result["output_throughput"] == pytest.approx(
        NUM_PROMPTS * OUTPUT_LEN / result["duration"])
    assert any(result["generated_texts"])
    cpu = result["client_cpu_util"]
    assert len(cpu["per_process"]) == result["num_clients"]
    assert all(0 < u < 2 for u in cpu["per_process"]) and cpu["max"] == max(cpu["per_process"])
    assert any(line.startswith("Client CPU util (max / mean):") for line in lines)


def test_bench_serve_completions_against_sluice_serve(server: str, tmp_path: Path) -> None:
    listed = httpx.get(f"{server}/v1/models", timeout=10).json()["data"][0]["id"]
    out = run_bench(server, tmp_path / "completions.json", "--percentile-metrics",
                    "ttft,tpot,itl,e2el")
    result = read_results(tmp_path / "completions.json")
    check_result(out.stdout, result)
    assert result["model_id"] == listed and result["backend"] == "openai"
    assert result["request_rate"] == "inf" and result["max_concurrency"] is None
    assert result["num_prompts"] == NUM_PROMPTS


def test_bench_serve_chat_with_rate_and_concurrency(server: str, qwen3_dir: str,
                                                    tmp_path: Path) -> None:
    out = run_bench(server, tmp_path / "chat.json", "--endpoint", "/v1/chat/completions",
                    "--tokenizer", qwen3_dir, "--request-rate", "20", "--burstiness", "0.5",
                    "--max-concurrency", "2", "--goodput", "ttft:600000", "tpot:600000",
                    "--percentile-metrics", "ttft,tpot,itl,e2el")
    result = read_results(tmp_path / "chat.json")
    check_result(out.stdout, result)
    assert result["backend"] == "openai-chat" and result["max_concurrency"] == 2
    assert result["max_concurrent_requests"] <= 2
    assert result["request_rate"] == 20.0 and result["burstiness"] == 0.5
    # Generous SLOs: every request is good.
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert f"{'Maximum request concurrency:':<40} {2:<10}" in out.stdout.splitlines()
    # The chat template wraps each prompt, so the server counts more than the prompt's tokens.
    assert all(n > INPUT_LEN for n in result["input_lens"])


def test_bench_serve_random_prompts_have_the_asked_length(server: str, qwen3_dir: str,
                                                          tmp_path: Path) -> None:
    run_bench(server, tmp_path / "lens.json", "--tokenizer", qwen3_dir)
    result = read_results(tmp_path / "lens.json")
    # input_lens are the server's usage.prompt_tokens: the prompts tokenize to the asked length.
    assert result["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN


def test_bench_serve_two_client_processes_complete_the_same_requests_as_one(
        server: str, qwen3_dir: str, tmp_path: Path) -> None:
    results = {}
    for num_clients in (1, 2):
        path = tmp_path / f"clients{num_clients}.json"
        out = run_bench(server, path, "--tokenizer", qwen3_dir, "--max-concurrency", "4",
                        "--num-clients", str(num_clients), "--seed", "7",
                        "--percentile-metrics", "ttft,tpot,itl,e2el")
        results[num_clients] = result = read_results(path)
        check_result(out.stdout, result)
        assert result["num_clients"] == num_clients and result["max_concurrent_requests"] <= 4
    one, two = results[1], results[2]
    # Same seed, same prompts: the server counts the same prompt tokens for each request.
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                "input_lens", "output_lens"):
        assert one[key] == two[key], key
    assert len(two["client_cpu_util"]["per_process"]) == 2
