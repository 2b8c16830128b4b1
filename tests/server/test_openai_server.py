"""The OpenAI API of `sluice serve`, driven by the official `openai` client (and raw HTTP where
the wire format itself is the point): outputs equal `LLM.generate` / `LLM.chat` with the same
greedy or seeded parameters, streamed or not; usage counts are exact; streams end with [DONE];
many concurrent streams are all right; a client that goes away frees its blocks at once."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from sluice import LLM, SamplingParams
from sluice.outputs import RequestOutput
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.serial

MODEL = "tiny"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def sse_events(server: ServerProcess, path: str, body: dict[str, Any]) -> list[str]:
    """The `data:` payloads of a streamed response, as sent."""
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    assert all(line.startswith("data: ") for line in lines if line)
    assert all(lines[i] == "" for i in range(1, len(lines), 2))  # one blank line per event
    return [line[len("data: "):] for line in lines if line]


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def assert_choices_equal(choices: dict[int, dict[str, Any]], expected: list[RequestOutput],
                         n: int) -> None:
    assert sorted(choices) == list(range(len(expected) * n))
    for p, want in enumerate(expected):
        for sample in want.outputs:
            got = choices[p * n + sample.index]
            assert got["text"] == sample.text, (p, sample.index)
            assert got["finish_reason"] == sample.finish_reason


def usage_of(expected: list[RequestOutput]) -> tuple[int, int]:
    return (sum(len(out.prompt_token_ids) for out in expected),
            sum(len(s.token_ids) for out in expected for s in out.outputs))


COMPLETION_CASES = [
    pytest.param(["Hello world", "A", "The quick brown fox"],
                 dict(temperature=0.0, max_tokens=12), id="greedy-three-prompts"),
    pytest.param([list(range(20, 45))], dict(temperature=0.0, max_tokens=12), id="greedy-ids"),
    pytest.param(["Once upon a time"],
                 dict(n=3, temperature=0.8, top_p=0.9, seed=5, max_tokens=10,
                      extra={"top_k": 50, "ignore_eos": True}), id="seeded-n3"),
    pytest.param([[7, 8, 9, 10], [30, 31]],
                 dict(n=2, temperature=1.0, seed=11, max_tokens=8, presence_penalty=0.5,
                      frequency_penalty=0.3, extra={"repetition_penalty": 1.2, "min_p": 0.05,
                                                    "min_tokens": 4}), id="penalties-ids"),
]


def to_sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    kwargs = dict(kwargs)
    extra = kwargs.pop("extra", {})
    return SamplingParams(**kwargs, **extra)


def to_request(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    extra = kwargs.pop("extra", {})
    return {**kwargs, "extra_body": extra}


@pytest.mark.parametrize(("prompts", "kwargs"), COMPLETION_CASES)
def test_completions_equal_llm_generate(server: ServerProcess, reference: LLM,
                                        prompts: list[Any], kwargs: dict[str, Any]) -> None:
    params = to_sampling_params(kwargs)
    expected = reference.generate([p if isinstance(p, str) else {"prompt_token_ids": p}
                                   for p in prompts], params, use_tqdm=False)
    prompt_arg = prompts[0] if len(prompts) == 1 else prompts
    c = client(server)

    full = c.completions.create(model=MODEL, prompt=prompt_arg, **to_request(kwargs))
    assert full.id.startswith("cmpl-") and full.model == MODEL and full.object == "text_completion"
    assert abs(full.created - time.time()) < 60
    assert_choices_equal({ch.index: ch.model_dump() for ch in full.choices}, expected, params.n)
    prompt_tokens, completion_tokens = usage_of(expected)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == \
        (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)

    streamed: dict[int, dict[str, Any]] = {}
    chunks = list(c.completions.create(model=MODEL, prompt=prompt_arg, stream=True,
                                       stream_options={"include_usage": True},
                                       **to_request(kwargs)))
    assert len({chunk.id for chunk in chunks}) == 1
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1 and chunk.usage is None
        choice = chunk.choices[0]
        got = streamed.setdefault(choice.index, {"text": "", "finish_reason": None})
        assert got["finish_reason"] is None  # nothing after a choice's last chunk
        got["text"] += choice.text
        got["finish_reason"] = choice.finish_reason
    assert_choices_equal(streamed, expected, params.n)
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (prompt_tokens, completion_tokens)


def test_stream_wire_format_role_chunk_usage_and_done(server: ServerProcess,
                                                      reference: LLM) -> None:
    expected = reference.chat(CHAT, greedy(6, ignore_eos=True), use_tqdm=False)[0]
    events = sse_events(server, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_completion_tokens": 6, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-")
               for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) == \
        expected.outputs[0].text
    assert [c["choices"][0]["finish_reason"] for c in content] == \
        [None] * (len(content) - 1) + ["length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    details = chunks[-1]["usage"].pop("prompt_tokens_details")
    assert details["cached_tokens"] < len(expected.prompt_token_ids)  # the last is recomputed
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": len(expected.prompt_token_ids), "completion_tokens": 6,
        "total_tokens": len(expected.prompt_token_ids) + 6}

    # Without include_usage: no usage chunk, and still [DONE] last.
    events = sse_events(server, "/v1/completions", {"model": MODEL, "prompt": "Hello",
                                                    "max_tokens": 3, "stream": True})
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["choices"] for e in events[:-1])


@pytest.mark.parametrize("n", [1, 2])
def test_chat_completions_equal_llm_chat(server: ServerProcess, reference: LLM, n: int) -> None:
    params = SamplingParams(n=n, temperature=0.7, seed=3, max_tokens=16)
    expected = reference.chat(CHAT, params, use_tqdm=False)[0]
    c = client(server)
    full = c.chat.completions.create(model="tiny-alias", messages=CHAT, n=n, temperature=0.7,
                                     seed=3, max_tokens=16)
    assert full.id.startswith("chatcmpl-") and full.model == "tiny-alias"
    assert [(ch.index, ch.message.role, ch.message.content, ch.finish_reason)
            for ch in full.choices] == [(s.index, "assistant", s.text, s.finish_reason)
                                        for s in expected.outputs]
    assert full.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert full.usage.completion_tokens == sum(len(s.token_ids) for s in expected.outputs)

    texts = [""] * n
    finish: list[str | None] = [None] * n
    for chunk in c.chat.completions.create(model=MODEL, messages=CHAT, n=n, temperature=0.7,
                                           seed=3, max_completion_tokens=16, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    assert texts == [s.text for s in expected.outputs]
    assert finish == [s.finish_reason for s in expected.outputs]


def find_stop_string(reference: LLM, prompt: str) -> str:
    """A stop string that spans two tokens of the greedy output."""
    tok = reference.get_tokenizer()
    full = reference.generate([prompt], greedy(24, ignore_eos=True), use_tqdm=False)[0]
    pieces = [tok.decode([t]) for t in full.outputs[0].token_ids]
    for i in range(2, len(pieces) - 1):
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2 and "\ufffd" not in pieces[i]:
            return pieces[i][-1] + pieces[i + 1][:1]
    pytest.skip("no two consecutive multi-character tokens in this output")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(server: ServerProcess, reference: LLM, include: bool) -> None:
    prompt = "The quick brown fox"
    stop = find_stop_string(reference, prompt)
    params = greedy(24, ignore_eos=True, stop=[stop, "never-seen"],
                    include_stop_str_in_output=include)
    want = reference.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and want.stop_reason == stop
    extra = {"ignore_eos": True, "include_stop_str_in_output": include}
    c = client(server)
    got = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                               stop=[stop, "never-seen"], extra_body=extra).choices[0]
    assert (got.text, got.finish_reason) == (want.text, "stop")
    assert got.model_extra["stop_reason"] == stop
    assert got.text.endswith(stop) == include
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body=extra))
    assert streamed == want.text


def test_completion_logprobs_equal_the_reference(server: ServerProcess, reference: LLM) -> None:
    prompt = "Logprobs, please"
    want = reference.generate([prompt], greedy(6, ignore_eos=True, logprobs=3),
                              use_tqdm=False)[0].outputs[0]
    got = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                            temperature=0, logprobs=3,
                                            extra_body={"ignore_eos": True}).choices[0]
    assert got.text == want.text
    logprobs = got.logprobs
    offset = 0
    for i, (token_id, position) in enumerate(zip(want.token_ids, want.logprobs)):
        chosen = position[token_id]
        assert logprobs.tokens[i] == chosen.decoded_token
        assert logprobs.token_logprobs[i] == pytest.approx(chosen.logprob, abs=1e-4)
        top = {lp.decoded_token: lp.logprob for t, lp in position.items()
               if lp.rank <= 3 or t == token_id}
        assert logprobs.top_logprobs[i] == pytest.approx(top, abs=1e-4)
        assert logprobs.text_offset[i] == offset
        offset += len(chosen.decoded_token)


def test_chat_logprobs_equal_the_reference(server: ServerProcess, reference: LLM) -> None:
    want = reference.chat(CHAT, greedy(5, ignore_eos=True, logprobs=2),
                          use_tqdm=False)[0].outputs[0]
    got = client(server).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True}).choices[0]
    assert got.message.content == want.text
    assert len(got.logprobs.content) == 5
    for entry, token_id, position in zip(got.logprobs.content, want.token_ids, want.logprobs):
        chosen = position[token_id]
        assert entry.token == chosen.decoded_token
        assert entry.bytes == list(chosen.decoded_token.encode())
        assert entry.logprob == pytest.approx(chosen.logprob, abs=1e-4)
        top = sorted((lp for lp in position.values() if lp.rank <= 2), key=lambda lp: lp.rank)
        assert [t.token for t in entry.top_logprobs] == [lp.decoded_token for lp in top]
        assert [t.logprob for t in entry.top_logprobs] == \
            pytest.approx([lp.logprob for lp in top], abs=1e-4)


def test_echo_prepends_the_prompt(server: ServerProcess, reference: LLM) -> None:
    want = reference.generate(["Echo this"], greedy(4, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    c = client(server)
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="Echo this", max_tokens=4, temperature=0,
                                  echo=True, extra_body={"ignore_eos": True})
    assert c.completions.create(**kwargs).choices[0].text == "Echo this" + want.text
    assert "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kwargs)) \
        == "Echo this" + want.text


def test_32_concurrent_streams_all_finish_right(server: ServerProcess, reference: LLM) -> None:
    prompts = [f"Client {i} asks about item {i * 7}" for i in range(32)]
    max_tokens = [4 + i % 13 for i in range(32)]
    expected = reference.generate(prompts, [greedy(m, ignore_eos=i % 2 == 0) for i, m in
                                            enumerate(max_tokens)], use_tqdm=False)

    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        text, finish, usage = "", None, None
        stream = await c.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": i % 2 == 0})
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
            usage = chunk.usage or usage
        assert usage is not None
        return text, finish, usage.completion_tokens

    async def main() -> list[tuple[str, str | None, int]]:
        c = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(32)))
        finally:
            await c.close()

    results = asyncio.run(main())
    for (text, finish, num_tokens), want in zip(results, expected):
        out = want.outputs[0]
        assert (text, finish, num_tokens) == (out.text, out.finish_reason, len(out.token_ids))


def wait_for_idle_engine(server: ServerProcess, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        scheduler = server.engine_info()["scheduler"]
        if scheduler["num_running"] + scheduler["num_waiting"] == 0 or \
                time.monotonic() > deadline:
            return scheduler
        time.sleep(0.05)


def wait_until_running(server: ServerProcess, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.engine_info()["scheduler"]["num_running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


LONG = {"model": MODEL, "prompt": "Keep going", "max_tokens": 1000, "n": 2, "temperature": 1.0,
        "seed": 1, "ignore_eos": True}


def test_a_stream_closed_mid_way_is_aborted_and_its_blocks_freed(server: ServerProcess) -> None:
    aborts = metric(server, "sluice:request_success_total", finished_reason="abort")
    generated = metric(server, "sluice:generation_tokens_total")
    with httpx.stream("POST", f"{server.base_url}/v1/completions",
                      json={**LONG, "stream": True}, timeout=60) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data: ")) == 3
    scheduler = wait_for_idle_engine(server)
    assert scheduler["num_free_blocks"] == scheduler["num_blocks"]
    assert metric(server, "sluice:request_success_total", finished_reason="abort") == aborts + 1
    assert metric(server, "sluice:generation_tokens_total") - generated < 2 * 1000
    assert metric(server, "sluice:kv_cache_usage_perc") == 0.0
    assert metric(server, "sluice:num_requests_running") == 0.0


def test_a_non_streaming_client_that_leaves_aborts_its_request(server: ServerProcess) -> None:
    aborts = metric(server, "sluice:request_success_total", finished_reason="abort")

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(http.post(f"{server.base_url}/v1/completions",
                                                 json=LONG))
            await asyncio.to_thread(wait_until_running, server)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    scheduler = wait_for_idle_engine(server)
    assert scheduler["num_free_blocks"] == scheduler["num_blocks"]
    assert metric(server, "sluice:request_success_total", finished_reason="abort") == aborts + 1


def test_models_tokenize_detokenize_version_health(server: ServerProcess,
                                                   reference: LLM) -> None:
    c = client(server)
    models = c.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert models[0].model_extra["max_model_len"] == 1024
    assert models[0].model_extra["root"] == reference.llm_engine.model_config.model
    assert models[0].owned_by == "sluice"

    tok = reference.get_tokenizer()
    base = server.base_url
    body = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}).json()
    assert body == {"count": len(tok.encode("Hello world")), "max_model_len": 1024,
                    "tokens": tok.encode("Hello world")}
    # Over one slice of the JSON array the server builds, and without special tokens.
    long_text = "Hello world, again. " * 5000
    for special in (True, False):
        long = httpx.post(f"{base}/tokenize", json={"prompt": long_text,
                                                    "add_special_tokens": special}).json()
        want = tok.encode(long_text, add_special_tokens=special)
        assert len(want) > 16384 and long == {"count": len(want), "max_model_len": 1024,
                                              "tokens": want}
    chat = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    want = reference.chat(CHAT, greedy(1), use_tqdm=False)[0].prompt_token_ids
    assert chat["tokens"] == want and chat["count"] == len(want)
    assert httpx.post(f"{base}/detokenize", json={"tokens": body["tokens"]}).json() == \
        {"prompt": "Hello world"}
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{base}/tokenize", json={"prompt": "a", "messages": CHAT})
    assert both.status_code == 400

    import sluice

    assert httpx.get(f"{base}/version").json() == {"version": sluice.__version__}
    health = httpx.get(f"{base}/health")
    assert health.status_code == 200 and health.content == b""
    info = server.engine_info()
    assert info["dead_error"] is None and info["engine_core_pid"] > 0
    assert info["parallel"] == {"tensor_parallel_size": 1, "enable_expert_parallel": False}
