"""POST /v1/completions: one engine request per prompt, `n` samples each.

Choice `i` of prompt `p` has index `p * n + i`. Usage counts each prompt's tokens once and
every generated token of every choice, and `prompt_tokens_details.cached_tokens` the prompt
tokens served from the prefix cache. Streamed, each chunk carries one choice's new text (and its
logprobs, whose text offsets continue that choice's text); a choice's last chunk has its
finish_reason; `stream_options.include_usage` adds a chunk with no choices and the usage; the
stream ends with `data: [DONE]`. A failure after the stream started is an `error` event.

Evaluation harnesses (lm-eval's `local-completions`) score a text by `echo: true, logprobs: k`:
the choice's text starts with the prompt and its logprobs with the prompt's tokens, the first
of them without a logprob (nothing precedes it), the others with the engine's prompt logprobs.
`max_tokens: 0` (only with echo) returns the prompt alone: the engine needs one step, so one
token is generated and dropped. vLLM's `prompt_logprobs: k` returns the same prompt logprobs in
vLLM's shape (`choices[i].prompt_logprobs`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sluice.engine.detokenizer import decode_token
from sluice.engine.processors import RequestOutputKind
from sluice.entrypoints.openai.connection import run_until_disconnected
from sluice.entrypoints.openai.errors import OpenAIError
from sluice.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    PromptLogprob,
    PromptLogprobsList,
    usage,
)
from sluice.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    clamp_logprob,
    merge_streams,
    random_id,
    sse,
    sse_error,
)
from sluice.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs


def completion_logprobs(token_ids: list[int], positions: SampleLogprobs, num_top: int,
                        text_offset: int, result: CompletionLogProbs | None = None
                        ) -> CompletionLogProbs:
    """OpenAI's legacy logprobs: per token its text, its logprob, the top `num_top` (and the
    chosen token) as text -> logprob, and where its text starts in the choice's text."""
    result = result or CompletionLogProbs()
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


def vllm_prompt_logprobs(token_ids: list[int], positions: PromptLogprobs,
                         num_top: int) -> PromptLogprobsList:
    """vLLM's `prompt_logprobs`: per position None (the first) or the prompt's token and the
    top `num_top`, token id -> logprob, rank, text."""
    result: PromptLogprobsList = []
    for token_id, position in zip(token_ids, positions):
        if position is None:
            result.append(None)
            continue
        result.append({t: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                        decoded_token=lp.decoded_token)
                       for t, lp in position.items()
                       if t == token_id or (lp.rank is not None and lp.rank <= num_top)})
    return result


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", 400, "prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class _Shape:
    """How a request's engine outputs become choices."""

    n: int
    logprobs: int | None  # OpenAI's `logprobs`: top-N per token of the choice's text
    echo: bool
    prompt_only: bool  # max_tokens 0: the generated token is dropped
    prompt_logprobs: int | None  # vLLM's field, per choice


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        serving = self.serving
        model = serving.model_name(request.model)
        serving.check_engine()
        max_tokens = request.max_tokens
        prompt_only = max_tokens == 0
        if prompt_only:
            if not request.echo:
                raise OpenAIError("max_tokens must be an integer >= 1 (0 only with echo, for "
                                  "the prompt alone), got 0", 400, "max_tokens")
            max_tokens = 1
        # The prompt's logprobs serve both echo and vLLM's prompt_logprobs: ask for the more.
        wanted = [k for k in (request.logprobs if request.echo else None,
                              request.prompt_logprobs) if k is not None]
        params = serving.sampling_params(request, max_tokens, request.logprobs,
                                         max(wanted) if wanted else None)
        await serving.check_constraints(request, params)
        # A prompt of token ids is decoded to text only to echo it or log it.
        need_text = bool(request.echo) or serving.log_requests
        prompts = [await serving.tokenize_prompt(
            p, request.add_special_tokens, "prompt" if isinstance(request.prompt, str)
            else f"prompt[{i}]", need_text=need_text)
            for i, p in enumerate(_prompts(request.prompt))]
        for _, token_ids in prompts:
            serving.check_context(len(token_ids), None if prompt_only else request.max_tokens)
        kv_transfer_params = serving.kv_transfer_params(request, len(prompts))

        request_id = random_id("cmpl")
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        streams = []
        for i, (text, token_ids) in enumerate(prompts):
            sub_id = f"{request_id}-{i}"
            serving.log_request(sub_id, text, token_ids, params)
            streams.append(serving.engine.generate(
                {"prompt": text, "prompt_token_ids": token_ids}, params, sub_id, kind,
                kv_transfer_params=kv_transfer_params))
        prompt_texts = [text for text, _ in prompts]
        num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
        shape = _Shape(n=params.n, logprobs=request.logprobs, echo=request.echo,
                       prompt_only=prompt_only, prompt_logprobs=request.prompt_logprobs)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                self._stream(streams, request_id, model, shape, prompt_texts, num_prompt_tokens,
                             include_usage),
                media_type="text/event-stream")
        response = await run_until_disconnected(raw_request, self._full(
            streams, request_id, model, shape, prompt_texts, num_prompt_tokens))
        if response is None:
            return Response(status_code=499)  # nobody is listening
        return Response(response.model_dump_json(), media_type="application/json")

    def _choice(self, index: int, output: RequestOutput, sample: CompletionOutput,
                shape: _Shape, prompt_text: str | None, first: bool, text_offset: int
                ) -> CompletionResponseChoice:
        """One choice (or, streamed, one chunk of it: `first` is its first, which carries
        the echoed prompt and the prompt's logprobs)."""
        text = "" if shape.prompt_only else sample.text
        token_ids = [] if shape.prompt_only else sample.token_ids
        echo = shape.echo and first
        if echo:
            text = prompt_text + text
        logprobs = None
        if shape.logprobs is not None:
            logprobs = CompletionLogProbs()
            if echo:
                logprobs = self._prompt_part(output, shape.logprobs)
                text_offset = len(prompt_text)
            if sample.logprobs is not None:
                logprobs = completion_logprobs(token_ids, sample.logprobs, shape.logprobs,
                                               text_offset, logprobs)
        prompt_logprobs = None
        if shape.prompt_logprobs is not None and first and output.prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(output.prompt_token_ids,
                                                   output.prompt_logprobs, shape.prompt_logprobs)
        finish_reason = sample.finish_reason
        if shape.prompt_only and finish_reason is not None:
            finish_reason = "length"  # the prompt alone was asked for, whatever came next
        return CompletionResponseChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
            stop_reason=None if shape.prompt_only else sample.stop_reason,
            prompt_logprobs=prompt_logprobs)

    def _prompt_part(self, output: RequestOutput, num_top: int) -> CompletionLogProbs:
        """The echoed prompt's tokens in OpenAI's legacy logprobs; the first has none."""
        result = CompletionLogProbs()
        positions = output.prompt_logprobs or []
        offset = 0
        for i, token_id in enumerate(output.prompt_token_ids):
            position = positions[i] if i < len(positions) else None
            if position is None:
                token = decode_token(self.serving.engine.tokenizer, token_id)
                result.tokens.append(token)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                result.text_offset.append(offset)
                offset += len(token)
                continue
            completion_logprobs([token_id], [position], num_top, offset, result)
            offset = result.text_offset[-1] + len(result.tokens[-1])
        return result

    @staticmethod
    def _num_generated(sample: CompletionOutput, shape: _Shape) -> int:
        return 0 if shape.prompt_only else len(sample.token_ids)

    async def _full(self, streams: list[AsyncIterator[RequestOutput]], request_id: str,
                    model: str, shape: _Shape, prompt_texts: list[str | None],
                    num_prompt_tokens: int) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for prompt_index, output in merge_streams(streams):
            finals[prompt_index] = output
        choices = []
        num_generated = 0
        for prompt_index in range(len(streams)):
            output = finals[prompt_index]
            for sample in output.outputs:
                num_generated += self._num_generated(sample, shape)
                choices.append(self._choice(prompt_index * shape.n + sample.index, output,
                                            sample, shape, prompt_texts[prompt_index], True, 0))
        num_cached = sum(output.num_cached_tokens for output in finals.values())
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=usage(num_prompt_tokens, num_generated, num_cached))

    async def _stream(self, streams: list[AsyncIterator[RequestOutput]], request_id: str,
                      model: str, shape: _Shape, prompt_texts: list[str | None],
                      num_prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        started: set[int] = set()
        # choice index -> text offset of its next logprob token (by token texts, as _full has
        # them: a token ending in part of a character is sent later, its text offset not)
        token_offsets: dict[int, int] = {}
        finished: set[int] = set()
        num_cached: dict[int, int] = {}
        num_generated = 0
        try:
            async for prompt_index, output in merge_streams(streams):
                num_cached[prompt_index] = output.num_cached_tokens
                for sample in output.outputs:
                    index = prompt_index * shape.n + sample.index
                    if index in finished:
                        continue
                    # A choice starts once its prompt is done (its prompt logprobs complete).
                    if not sample.text and not sample.token_ids and sample.finish_reason is None:
                        continue
                    first = index not in started
                    choice = self._choice(index, output, sample, shape,
                                          prompt_texts[prompt_index], first,
                                          token_offsets.get(index, 0))
                    if not first and shape.prompt_only and choice.finish_reason is None:
                        continue
                    started.add(index)
                    if choice.logprobs is not None and choice.logprobs.tokens:
                        token_offsets[index] = (choice.logprobs.text_offset[-1]
                                                + len(choice.logprobs.tokens[-1]))
                    num_generated += self._num_generated(sample, shape)
                    if choice.finish_reason is not None:
                        finished.add(index)
                    yield sse(CompletionStreamResponse(id=request_id, created=created,
                                                       model=model, choices=[choice]))
            if include_usage:
                yield sse(CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=usage(num_prompt_tokens, num_generated, sum(num_cached.values()))))
        except Exception as exc:
            yield sse_error(exc)
        yield SSE_DONE
