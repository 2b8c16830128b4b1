"""POST /v1/completions: one engine request per prompt, `n` samples each.

Choice `i` of prompt `p` has index `p * n + i`. Usage counts each prompt's tokens once and
every generated token of every choice. Streamed, each chunk carries one choice's new text (and
its logprobs, whose text offsets continue that choice's text); a choice's last chunk has its
finish_reason; `stream_options.include_usage` adds a chunk with no choices and the usage; the
stream ends with `data: [DONE]`. A failure after the stream started is an `error` event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sluice.engine.processors import RequestOutputKind
from sluice.entrypoints.openai.errors import OpenAIError
from sluice.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from sluice.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    clamp_logprob,
    merge_streams,
    random_id,
    run_until_disconnected,
    sse,
    sse_error,
)
from sluice.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from sluice.sampling_params import SamplingParams


def completion_logprobs(token_ids: list[int], positions: SampleLogprobs, num_top: int,
                        text_offset: int) -> CompletionLogProbs:
    """OpenAI's legacy logprobs: per token its text, its logprob, the top `num_top` (and the
    chosen token) as text -> logprob, and where its text starts in the choice's text."""
    result = CompletionLogProbs()
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        token = chosen.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(clamp_logprob(chosen.logprob))
        result.top_logprobs.append({
            (lp.decoded_token or ""): clamp_logprob(lp.logprob)
            for t, lp in position.items()
            if t == token_id or (lp.rank is not None and lp.rank <= num_top)})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", 400, "prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        serving = self.serving
        model = serving.model_name(request.model)
        serving.check_engine()
        if request.suffix:
            raise OpenAIError("suffix is not supported", 400, "suffix")
        if request.echo and request.logprobs is not None:
            raise OpenAIError("echo together with logprobs is not supported", 400, "echo")
        params = serving.sampling_params(request, request.max_tokens, request.logprobs)
        prompts = [serving.tokenize_prompt(p) for p in _prompts(request.prompt)]
        for _, token_ids in prompts:
            serving.check_context(len(token_ids), request.max_tokens)

        request_id = random_id("cmpl")
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        streams = []
        for i, (text, token_ids) in enumerate(prompts):
            sub_id = f"{request_id}-{i}"
            serving.log_request(sub_id, text, token_ids, params)
            streams.append(serving.engine.generate(
                {"prompt": text, "prompt_token_ids": token_ids}, params, sub_id, kind))
        prompt_texts = [text for text, _ in prompts]
        num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                self._stream(streams, request_id, model, params, request.echo, prompt_texts,
                             num_prompt_tokens, include_usage),
                media_type="text/event-stream")
        response = await run_until_disconnected(raw_request, self._full(
            streams, request_id, model, params, request.echo, prompt_texts, num_prompt_tokens))
        if response is None:
            return Response(status_code=499)  # nobody is listening
        return Response(response.model_dump_json(), media_type="application/json")

    async def _full(self, streams: list[AsyncIterator[RequestOutput]], request_id: str,
                    model: str, params: SamplingParams, echo: bool, prompt_texts: list[str],
                    num_prompt_tokens: int) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for prompt_index, output in merge_streams(streams):
            finals[prompt_index] = output
        choices = []
        num_generated = 0
        for prompt_index in range(len(streams)):
            for sample in finals[prompt_index].outputs:
                num_generated += len(sample.token_ids)
                text = prompt_texts[prompt_index] + sample.text if echo else sample.text
                choices.append(self._choice(prompt_index * params.n + sample.index, text,
                                            sample, params, 0))
        return CompletionResponse(
            id=request_id, model=model, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                            total_tokens=num_prompt_tokens + num_generated))

    @staticmethod
    def _choice(index: int, text: str, sample: CompletionOutput, params: SamplingParams,
                text_offset: int) -> CompletionResponseChoice:
        logprobs = None
        if params.logprobs is not None and sample.logprobs is not None:
            logprobs = completion_logprobs(sample.token_ids, sample.logprobs, params.logprobs,
                                           text_offset)
        return CompletionResponseChoice(index=index, text=text, logprobs=logprobs,
                                        finish_reason=sample.finish_reason,
                                        stop_reason=sample.stop_reason)

    async def _stream(self, streams: list[AsyncIterator[RequestOutput]], request_id: str,
                      model: str, params: SamplingParams, echo: bool, prompt_texts: list[str],
                      num_prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        text_lengths: dict[int, int] = {}  # choice index -> characters sent so far
        finished: set[int] = set()
        num_generated = 0
        try:
            async for prompt_index, output in merge_streams(streams):
                for sample in output.outputs:
                    index = prompt_index * params.n + sample.index
                    if index in finished:
                        continue
                    text = sample.text
                    if echo and index not in text_lengths:
                        text = prompt_texts[prompt_index] + text
                    if not text and not sample.token_ids and sample.finish_reason is None:
                        continue
                    # Logprobs with echo are refused, so offsets never count the prompt.
                    choice = self._choice(index, text, sample, params,
                                          text_lengths.get(index, 0))
                    text_lengths[index] = text_lengths.get(index, 0) + len(text)
                    num_generated += len(sample.token_ids)
                    if sample.finish_reason is not None:
                        finished.add(index)
                    yield sse(CompletionStreamResponse(id=request_id, created=created,
                                                       model=model, choices=[choice]))
            if include_usage:
                usage = UsageInfo(prompt_tokens=num_prompt_tokens,
                                  completion_tokens=num_generated,
                                  total_tokens=num_prompt_tokens + num_generated)
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                   choices=[], usage=usage))
        except Exception as exc:
            yield sse_error(exc)
        yield SSE_DONE
