"""What evaluation harnesses and vLLM clients ask of /v1/completions beyond the basics: echo
with logprobs (lm-eval's loglikelihood requests), max_tokens 0, vLLM's prompt_logprobs, cached
token counts, X-Request-Id, GET /v1/models/{id}, and a 400 naming every field sluice does not
implement. Logprobs served equal the offline API's."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from sluice import LLM, SamplingParams
from sluice.outputs import RequestOutput
from tests.server.conftest import ServerProcess
from tests.server.test_server_errors import assert_error

pytestmark = pytest.mark.serial

MODEL = "tiny"
TEXT = "The quick brown fox jumps over the lazy dog"


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def offline(reference: LLM, prompt_ids: list[int], num_logprobs: int) -> RequestOutput:
    return reference.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(
        temperature=0, max_tokens=1, logprobs=num_logprobs, prompt_logprobs=num_logprobs),
        use_tqdm=False)[0]


def assert_prompt_part_equals(logprobs: Any, want: RequestOutput, num_top: int) -> None:
    """The first len(prompt) entries of OpenAI's legacy logprobs against the offline
    prompt_logprobs."""
    ids = want.prompt_token_ids
    assert want.prompt_logprobs is not None and want.prompt_logprobs[0] is None
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    offset = len(logprobs.tokens[0])
    assert logprobs.text_offset[0] == 0
    for i in range(1, len(ids)):
        position = want.prompt_logprobs[i]
        chosen = position[ids[i]]
        assert logprobs.tokens[i] == chosen.decoded_token
        assert logprobs.token_logprobs[i] == pytest.approx(chosen.logprob, abs=1e-5)
        top = {lp.decoded_token: lp.logprob for t, lp in position.items()
               if lp.rank <= num_top or t == ids[i]}
        assert logprobs.top_logprobs[i] == pytest.approx(top, abs=1e-5)
        assert logprobs.text_offset[i] == offset
        offset += len(chosen.decoded_token)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_requests_return_the_offline_prompt_logprobs(
        server: ServerProcess, reference: LLM, max_tokens: int) -> None:
    tokenizer = reference.get_tokenizer()
    prompts = [tokenizer.encode(TEXT), tokenizer.encode("Paris is the capital of France")]
    # lm-eval's local-completions: token ids, echo, logprobs 1, max_tokens 0 or 1, greedy.
    response = client(server).completions.create(model=MODEL, prompt=prompts, echo=True,
                                                 logprobs=1, max_tokens=max_tokens,
                                                 temperature=0)
    assert response.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert response.usage.completion_tokens == max_tokens * len(prompts)
    for choice, prompt_ids in zip(response.choices, prompts):
        want = offline(reference, prompt_ids, 1)
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == len(prompt_ids) + max_tokens
        assert_prompt_part_equals(logprobs, want, 1)
        prompt_text = tokenizer.decode(prompt_ids)
        generated = want.outputs[0]
        if max_tokens == 0:
            assert choice.text == prompt_text and choice.finish_reason == "length"
        else:
            assert choice.text == prompt_text + generated.text
            chosen = generated.logprobs[0][generated.token_ids[0]]
            assert logprobs.token_logprobs[-1] == pytest.approx(chosen.logprob, abs=1e-5)
            assert logprobs.text_offset[-1] == len(prompt_text)
        # lm-eval's own arithmetic: the continuation's logprob and its greediness.
        continuation = logprobs.token_logprobs[3:len(prompt_ids)]
        assert sum(continuation) == pytest.approx(sum(
            want.prompt_logprobs[i][prompt_ids[i]].logprob
            for i in range(3, len(prompt_ids))), abs=1e-4)


def test_echo_logprobs_of_a_text_prompt_streamed_and_not(server: ServerProcess,
                                                         reference: LLM) -> None:
    prompt_ids = reference.get_tokenizer().encode(TEXT)
    want = offline(reference, prompt_ids, 2)
    c = client(server)
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=TEXT, echo=True, logprobs=2,
                                  max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    full = c.completions.create(**kwargs).choices[0]
    assert full.text.startswith(TEXT)
    assert_prompt_part_equals(full.logprobs, want, 2)
    assert len(full.logprobs.tokens) == len(prompt_ids) + 3
    text, tokens, token_logprobs, offsets = "", [], [], []
    for chunk in c.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens
            token_logprobs += choice.logprobs.token_logprobs
            offsets += choice.logprobs.text_offset
    assert text == full.text and tokens == full.logprobs.tokens
    assert offsets == full.logprobs.text_offset
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-5)


def test_vllm_prompt_logprobs_equal_the_offline_api(server: ServerProcess,
                                                    reference: LLM) -> None:
    prompt_ids = reference.get_tokenizer().encode(TEXT)
    want = offline(reference, prompt_ids, 3)
    body = httpx.post(f"{server.base_url}/v1/completions", json={
        "model": MODEL, "prompt": prompt_ids, "max_tokens": 1, "prompt_logprobs": 3},
        timeout=60).json()
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt_ids)
    for i in range(1, len(prompt_ids)):
        position = want.prompt_logprobs[i]
        assert set(got[i]) == {str(t) for t in position}
        for token_id, lp in position.items():
            entry = got[i][str(token_id)]
            assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert (entry["rank"], entry["decoded_token"]) == (lp.rank, lp.decoded_token)
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 1,
        "prompt_logprobs": 1}, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert_error(httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
        "prompt_logprobs": 1}), 400, "BadRequestError", "prompt_logprobs", "stream")


def test_max_tokens_0_needs_echo(server: ServerProcess) -> None:
    assert_error(httpx.post(f"{server.base_url}/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 0}), 400, "BadRequestError",
        "max_tokens", "0 only with echo")
    streamed = [json.loads(line[6:]) for line in httpx.post(
        f"{server.base_url}/v1/completions", json={
            "model": MODEL, "prompt": TEXT, "max_tokens": 0, "echo": True, "stream": True,
            "stream_options": {"include_usage": True}}, timeout=60).text.splitlines()
        if line.startswith("data: {")]
    assert [c["choices"][0]["text"] for c in streamed[:-1]] == [TEXT]
    assert streamed[0]["choices"][0]["finish_reason"] == "length"
    assert streamed[-1]["usage"]["completion_tokens"] == 0


def test_cached_tokens_are_reported(server: ServerProcess) -> None:
    prompt = [(7 * i) % 500 + 3 for i in range(61)]  # 61 tokens: 7 full blocks of 8
    c = client(server)
    first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 56
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 56


def test_x_request_id_is_echoed(server: ServerProcess) -> None:
    base = server.base_url
    for method, path, body, status in (
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}, 200),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                         "stream": True}, 200),
            ("GET", "/health", None, 200)):
        response = httpx.request(method, f"{base}{path}", json=body,
                                 headers={"X-Request-Id": "trace-42"}, timeout=60)
        assert response.status_code == status
        assert response.headers["x-request-id"] == "trace-42"
    assert "x-request-id" not in httpx.get(f"{base}/health").headers


def test_get_one_model(server: ServerProcess) -> None:
    c = client(server)
    for name in ("tiny", "tiny-alias"):
        card = c.models.retrieve(name)
        assert (card.id, card.object, card.owned_by) == (name, "model", "sluice")
        assert card.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as info:
        c.models.retrieve("gpt-9")
    assert info.value.body["param"] == "model" and "gpt-9" in info.value.body["message"]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


@pytest.mark.parametrize(("body", "param", "match"), [
    (CHAT | {"response_format": {"type": "structural_tag"}}, "response_format",
     "text, json_object or json_schema"),
    (COMPLETION | {"guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "'xgrammar'"),
    (CHAT | {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern",
     "disable_any_whitespace"),
    (COMPLETION | {"suffix": "end"}, "suffix", "not supported yet"),
    (COMPLETION | {"use_beam_search": True}, "use_beam_search", "not supported yet"),
    (CHAT | {"functions": [{"name": "f"}]}, "functions", "use tools"),
    (CHAT | {"function_call": "auto"}, "function_call", "use tool_choice"),
    (CHAT | {"modalities": ["text", "audio"]}, "modalities", "text only"),
    (CHAT | {"audio": {"voice": "alloy"}}, "audio", "not supported yet"),
    (CHAT | {"reasoning_effort": "high"}, "reasoning_effort", "enable_thinking"),
    (CHAT | {"store": True}, "store", "nothing is stored"),
    (CHAT | {"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    (CHAT | {"echo": True}, "echo", "not supported yet in chat"),
    (COMPLETION | {"allowed_token_ids": [1, 2]}, "allowed_token_ids", "not supported yet"),
    (COMPLETION | {"priority": 5}, "priority", "first come, first served"),
])
def test_unsupported_fields_are_400s_naming_them(server: ServerProcess, body: dict[str, Any],
                                                 param: str, match: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert_error(httpx.post(f"{server.base_url}{path}", json=body, timeout=60), 400,
                 "BadRequestError", param, match)


def test_neutral_values_of_unsupported_fields_are_accepted(server: ServerProcess) -> None:
    neutral = {"response_format": {"type": "text"}, "logit_bias": {}, "modalities": ["text"],
               "store": False, "use_beam_search": False, "user": "u-1",
               "metadata": {"k": "v"}, "service_tier": "auto"}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=CHAT | neutral,
                          timeout=60)
    assert response.status_code == 200, response.text
