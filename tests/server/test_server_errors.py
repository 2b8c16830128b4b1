"""Failures of `sluice serve`, each with OpenAI's error body and the right status, and the server
still serving afterwards: bad parameters, over-long prompts, unknown models, malformed JSON,
missing or wrong API keys; a killed engine core (503, in-flight streams end with an error);
SIGTERM draining in-flight requests before a clean exit."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.engine.test_executor import alive
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.serial

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"


@pytest.fixture(scope="module")
def keyed_server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ServerProcess]:
    from tests.server.conftest import launch_server

    started = launch_server(qwen3_dir, tmp_path_factory.mktemp("keyed") / "server.log",
                            "--api-key", KEY, "--served-model-name", MODEL)
    yield started
    assert started.stop() == 0


def post(server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = None,
         **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body,
                      headers=AUTH if headers is None else headers, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, error_type: str,
                 param: str | None = None, match: str = "") -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (error_type, status, param)
    assert match in error["message"]
    return error["message"]


def assert_still_serving(server: ServerProcess) -> None:
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "still ok?",
                                                "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize(("path", "body", "param", "match"), [
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}, "max_tokens",
     "max_tokens must be an integer >= 1, got -1"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {**COMPLETION, "top_p": 7}, "top_p", "top_p must be in (0, 1], got 7"),
    ("/v1/chat/completions", {**CHAT, "top_p": 7}, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", {**COMPLETION, "temperature": -0.5}, "temperature", ">= 0"),
    ("/v1/completions", {**COMPLETION, "n": 129}, "n", "n must be an integer in [1, 128]"),
    ("/v1/completions", {**COMPLETION, "n": 0}, "n", "n must be an integer >= 1"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs", "[0, 20], got 21"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "[0, 20], got 21"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("/v1/completions", {**COMPLETION, "stop": ""}, "stop", "non-empty strings"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 9}, "min_tokens", "<= max_tokens (4)"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, "max_tokens",
     "valid integer"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt", "must be a string"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt", "non-empty"),
    ("/v1/completions", {**COMPLETION, "prompt": [10**6]}, "prompt", "prompt_token_ids must"),
    ("/v1/completions", {**COMPLETION, "prompt": [-3]}, "prompt", "token id -3 is out of range"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [-1]}, "stop_token_ids",
     "greater than or equal"),
    ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed", "less than or equal"),
    ("/v1/completions", {"model": MODEL}, "prompt", "Field required"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "must not be empty"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     "messages", "messages.0.role"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101}}, "logit_bias",
     "values in [-100, 100] (token 5), got 101"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"five": 1}}, "logit_bias",
     "token ids (integers), got 'five'"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"100000": 1}}, "logit_bias",
     "outside the vocabulary [0, "),
])
def test_bad_parameters_are_400s_naming_the_param(keyed_server: ServerProcess, path: str,
                                                  body: dict[str, Any], param: str,
                                                  match: str) -> None:
    assert_error(post(keyed_server, path, body), 400, "BadRequestError", param, match)
    assert_still_serving(keyed_server)


def test_prompts_over_the_context_are_400s_with_vllms_message(
        keyed_server: ServerProcess) -> None:
    message = assert_error(post(keyed_server, "/v1/completions",
                                {**COMPLETION, "prompt": [5] * 1100}), 400, "BadRequestError",
                           "max_tokens")
    assert message == ("This model's maximum context length is 1024 tokens. However, you "
                       "requested 1104 tokens (1100 in the messages, 4 in the completion). "
                       "Please reduce the length of the messages or completion.")
    assert_error(post(keyed_server, "/v1/completions",
                      {**COMPLETION, "prompt": [5] * 1000, "max_tokens": 30}),
                 400, "BadRequestError", "max_tokens", "you requested 1030 tokens (1000 in")
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 1200}]}
    long_chat.pop("max_tokens")
    assert_error(post(keyed_server, "/v1/chat/completions", long_chat), 400, "BadRequestError",
                 "messages", "maximum context length is 1024 tokens. However, your request has")
    # Exactly full is fine: 1000 + 24 = 1024.
    ok = post(keyed_server, "/v1/completions",
              {**COMPLETION, "prompt": [5] * 1000, "max_tokens": 24, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == 1024
    assert_still_serving(keyed_server)


def test_unknown_model_malformed_json_and_unknown_route(keyed_server: ServerProcess) -> None:
    assert_error(post(keyed_server, "/v1/chat/completions", {**CHAT, "model": "gpt-9"}), 404,
                 "NotFoundError", "model", "The model `gpt-9` does not exist")
    for raw in (b"{not json", b"", b"[1, 2]", b'"text"'):
        response = httpx.post(f"{keyed_server.base_url}/v1/completions", content=raw,
                              headers={**AUTH, "Content-Type": "application/json"})
        assert_error(response, 400, "BadRequestError")
    message = assert_error(httpx.post(f"{keyed_server.base_url}/v1/completions",
                                      content=b"{not json", headers={
                                          **AUTH, "Content-Type": "application/json"}),
                           400, "BadRequestError")
    assert "not valid JSON" in message
    assert_error(httpx.get(f"{keyed_server.base_url}/v1/nowhere", headers=AUTH), 404,
                 "NotFoundError")
    assert_error(httpx.get(f"{keyed_server.base_url}/v1/completions", headers=AUTH), 405,
                 "MethodNotAllowedError")
    assert_still_serving(keyed_server)


def test_api_key_guards_every_v1_path(keyed_server: ServerProcess) -> None:
    base = keyed_server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        assert_error(httpx.get(f"{base}/v1/models", headers=headers), 401,
                     "AuthenticationError", match="API key")
        assert_error(httpx.post(f"{base}/v1/completions", json=COMPLETION, headers=headers),
                     401, "AuthenticationError")
        assert_error(httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=headers),
                     401, "AuthenticationError")
        assert_error(httpx.get(f"{base}/debug/engine", headers=headers), 401,
                     "AuthenticationError")
    # Health, metrics, version and tokenizing are not behind the key (as in vLLM).
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{base}{path}").status_code == 200
    assert httpx.post(f"{base}/tokenize", json={"prompt": "hi"}).status_code == 200
    # The official client, with and without the key.
    good = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        good.completions.create(model=MODEL, prompt="x", max_tokens=-5)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="other", prompt="x", max_tokens=2)
    assert_still_serving(keyed_server)


class StreamReader(threading.Thread):
    """Reads one streamed completion in the background: text, usage, and the error it ended
    with (if any)."""

    def __init__(self, server: ServerProcess, api_key: str = "unused", **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key,
                                    max_retries=0, timeout=60)
        self.kwargs = kwargs
        self.first_chunk = threading.Event()
        self.text = ""
        self.usage: Any = None
        self.error: BaseException | None = None
        self.ended_at = 0.0

    def run(self) -> None:
        try:
            for chunk in self.client.completions.create(stream=True, **self.kwargs):
                for choice in chunk.choices:
                    self.text += choice.text
                self.usage = chunk.usage or self.usage
                self.first_chunk.set()
        except BaseException as exc:  # the test looks at it
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()


def test_killing_the_engine_core_gives_503_and_ends_streams_with_an_error(
        make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--served-model-name", MODEL)
    readers = [StreamReader(server, model=MODEL, prompt=f"Victim {i}", max_tokens=1000,
                            extra_body={"ignore_eos": True}) for i in range(2)]
    for reader in readers:
        reader.start()
    for reader in readers:
        assert reader.first_chunk.wait(30)
    pid = server.engine_info()["engine_core_pid"]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for reader in readers:
        reader.join(10)
        assert not reader.is_alive()
        assert isinstance(reader.error, openai.APIError), reader.error
        assert "status -9" in str(reader.error)
        assert reader.ended_at - killed_at < 5.0
    health = httpx.get(f"{server.base_url}/health")
    message = assert_error(health, 503, "ServiceUnavailableError", match="the engine is dead")
    assert "status -9" in message
    for path, body in (("/v1/completions", {"prompt": "after", "max_tokens": 2}),
                       ("/v1/chat/completions", CHAT | {"model": None})):
        assert_error(post(server, path, body, headers={}), 503, "ServiceUnavailableError",
                     match="the engine is dead")
    assert server.engine_info()["dead_error"] is not None
    assert server.stop() == 0


def test_sigterm_drains_in_flight_requests_then_exits_0(
        make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--served-model-name", MODEL)
    reader = StreamReader(server, model=MODEL, prompt="Drain me", max_tokens=1000, n=8,
                          temperature=1.0, seed=0, stream_options={"include_usage": True},
                          extra_body={"ignore_eos": True})
    reader.start()
    assert reader.first_chunk.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while httpx.get(f"{server.base_url}/health").status_code == 200:
        assert time.monotonic() < deadline, "still healthy after SIGTERM"
        time.sleep(0.02)
    assert reader.is_alive(), "the stream ended before the drain could be seen"
    assert_error(httpx.get(f"{server.base_url}/health"), 503, "ServiceUnavailableError",
                 match="shutting down")
    assert_error(post(server, "/v1/completions", COMPLETION), 503, "ServiceUnavailableError",
                 match="shutting down")
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200
    reader.join(60)
    assert reader.error is None and reader.usage.completion_tokens == 8 * 1000
    assert server.proc.wait(30) == 0
    log = server.log()
    assert "SIGTERM: draining 1 request(s) in flight" in log and "server stopped" in log


def _stream_past_first_token(server: ServerProcess) -> tuple[threading.Thread, dict[str, object]]:
    """A long streamed completion of model "m" on a thread, returned once its first token is
    in; `result` gets "error" (the openai.APIError, if any) and "ended" (when it ended)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    result: dict[str, object] = {}

    def stream() -> None:
        try:
            for _ in client.completions.create(model="m", prompt="victim", max_tokens=1000,
                                               stream=True, extra_body={"ignore_eos": True}):
                result.setdefault("first", time.monotonic())
        except openai.APIError as exc:
            result["error"] = exc
        result["ended"] = time.monotonic()

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while "first" not in result:
        assert time.monotonic() < deadline and reader.is_alive()
        time.sleep(0.01)
    return reader, result


def test_killing_a_worker_behind_the_server_gives_503_and_leaves_no_process(
        make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--distributed-executor-backend", "mp", "--served-model-name", "m")
    info = server.engine_info()
    (worker_pid,) = info["worker_pids"]
    core_pid = info["engine_core_pid"]
    reader, result = _stream_past_first_token(server)
    os.kill(worker_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    reader.join(10)
    assert "worker rank 0" in str(result.get("error")), result
    assert result["ended"] - killed_at < 5.0
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 503 and "worker rank 0" in health.text
    assert server.stop() == 0
    assert not alive(core_pid) and not alive(worker_pid)


def test_killing_a_tensor_parallel_rank_gives_503_and_leaves_no_process(
        make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--tensor-parallel-size", "2", "--served-model-name", "m")
    info = server.engine_info()
    pids = info["worker_pids"]
    assert len(set(pids)) == 2
    reader, result = _stream_past_first_token(server)
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    reader.join(10)
    assert f"worker rank 1 (pid {pids[1]}) exited" in str(result.get("error")), result
    assert result["ended"] - killed_at < 5.0
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 503 and "worker rank 1" in health.text
    # Rank 0 (which may have been blocked in a collective with rank 1) is gone too.
    while alive(pids[0]):
        assert time.monotonic() - killed_at < 5.0, "rank 0 outlived its peer by 5 s"
        time.sleep(0.02)
    assert server.stop() == 0
    assert not any(alive(pid) for pid in [info["engine_core_pid"], *pids])




def test_a_worker_that_dies_while_the_server_is_idle_gives_503_within_5_s(
        make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--distributed-executor-backend", "mp")
    (worker_pid,) = server.engine_info()["worker_pids"]
    os.kill(worker_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while httpx.get(f"{server.base_url}/health").status_code == 200:
        assert time.monotonic() - killed_at < 5.0, "still healthy 5 s after a worker died"
        time.sleep(0.05)
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 503 and "worker rank 0" in health.text
    assert server.stop() == 0
