"""`sluice serve` as users run it: a subprocess on a free loopback port (--port 0, read back
from its log), on the CPU with the tiny float32 model of tests/conftest.py, and an offline
`LLM` reference with the same engine settings in the test process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice import LLM

ENGINE_KWARGS: dict[str, Any] = dict(dtype="float32", max_model_len=1024, block_size=8, seed=0,
                                     device="cpu")
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", "8", "--seed",
                "0", "--device", "cpu"]
START_TIMEOUT_S = 120.0
_BOUND = re.compile(r"on http://127\.0\.0\.1:(\d+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log_path: Path
    base_url: str = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_info(self, **headers: str) -> dict[str, Any]:
        response = httpx.get(f"{self.base_url}/debug/engine", headers=headers, timeout=10)
        response.raise_for_status()
        return response.json()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"sluice serve exited with {self.proc.returncode}:\n"
                            f"{self.log()[-4000:]}")
            if not self.base_url:
                match = _BOUND.search(self.log())
                if match:
                    self.base_url = f"http://127.0.0.1:{match.group(1)}"
            if self.base_url:
                try:
                    if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        pytest.fail(f"sluice serve not healthy in {START_TIMEOUT_S} s:\n{self.log()[-4000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def launch_server(model_dir: str, log_path: Path, *extra: str) -> ServerProcess:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "serve", "--model", model_dir, "--port", "0",
             *ENGINE_FLAGS, *extra],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    server = ServerProcess(proc, log_path)
    try:
        server.wait_ready()
    except BaseException:
        server.stop(5.0)
        raise
    return server


@pytest.fixture(scope="session")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the plain-API tests, shared across modules (tests read counter deltas)."""
    started = launch_server(qwen3_dir, tmp_path_factory.mktemp("server") / "server.log",
                            "--served-model-name", "tiny", "tiny-alias")
    yield started
    assert started.stop() == 0, started.log()[-4000:]


@pytest.fixture
def make_server(qwen3_dir: str, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Servers a test may break; each is stopped when the test ends."""
    started: list[ServerProcess] = []

    def make(*extra: str) -> ServerProcess:
        started.append(launch_server(qwen3_dir, tmp_path / f"server-{len(started)}.log",
                                     *extra))
        return started[-1]

    yield make
    for s in started:
        s.stop(10.0)


@pytest.fixture(scope="session")
def reference(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, **ENGINE_KWARGS)
