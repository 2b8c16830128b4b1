"""POST /v1/chat/completions: the messages rendered with the tokenizer's chat template (with the
generation prompt), then one engine request with `n` samples.

`max_completion_tokens` wins over `max_tokens`; with neither, a reply may fill the context.
`logprobs: true` returns the chosen token's logprob, plus `top_logprobs` alternatives.
Streamed: first one role chunk per choice (`{"role": "assistant", "content": ""}`), then
content deltas, the last of a choice with its finish_reason, the usage chunk if asked for, and
`data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sluice.engine.processors import RequestOutputKind
from sluice.entrypoints.openai.errors import OpenAIError
from sluice.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatResponseMessage,
    DeltaMessage,
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
from sluice.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from sluice.sampling_params import MAX_LOGPROBS, SamplingParams


def _entry(logprob: Logprob) -> ChatLogProb:
    token = logprob.decoded_token or ""
    return ChatLogProb(token=token, logprob=clamp_logprob(logprob.logprob),
                       bytes=list(token.encode("utf-8")))


def chat_logprobs(token_ids: list[int], positions: SampleLogprobs,
                  num_top: int) -> ChatCompletionLogProbs:
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = _entry(position[token_id])
        top = sorted((lp for lp in position.values()
                      if lp.rank is not None and lp.rank <= num_top), key=lambda lp: lp.rank)
        content.append(ChatLogProbsContent(token=chosen.token, logprob=chosen.logprob,
                                           bytes=chosen.bytes,
                                           top_logprobs=[_entry(lp) for lp in top[:num_top]]))
    return ChatCompletionLogProbs(content=content)


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        serving = self.serving
        model = serving.model_name(request.model)
        serving.check_engine()
        num_logprobs = None
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise OpenAIError("top_logprobs needs logprobs set to true", 400,
                                  "top_logprobs")
            if not 0 <= request.top_logprobs <= MAX_LOGPROBS:
                raise OpenAIError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                                  f"got {request.top_logprobs}", 400, "top_logprobs")
        if request.logprobs:
            num_logprobs = request.top_logprobs or 0
        max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                      else request.max_tokens)
        params = serving.sampling_params(request, max_tokens, num_logprobs)
        token_ids = serving.tokenize_chat(request.messages, request.add_generation_prompt,
                                          request.chat_template_kwargs)
        serving.check_context(len(token_ids), max_tokens)

        request_id = random_id("chatcmpl")
        serving.log_request(request_id, None, token_ids, params)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        stream = serving.engine.generate({"prompt_token_ids": token_ids}, params, request_id,
                                         kind)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                self._stream(stream, request_id, model, params, len(token_ids), include_usage),
                media_type="text/event-stream")
        response = await run_until_disconnected(
            raw_request, self._full(stream, request_id, model, params, len(token_ids)))
        if response is None:
            return Response(status_code=499)  # nobody is listening
        return Response(response.model_dump_json(), media_type="application/json")

    @staticmethod
    def _logprobs(sample: CompletionOutput, params: SamplingParams
                  ) -> ChatCompletionLogProbs | None:
        if params.logprobs is None or sample.logprobs is None:
            return None
        return chat_logprobs(sample.token_ids, sample.logprobs, params.logprobs)

    async def _full(self, stream: AsyncIterator[RequestOutput], request_id: str, model: str,
                    params: SamplingParams, num_prompt_tokens: int) -> ChatCompletionResponse:
        final = None
        async for _, output in merge_streams([stream]):
            final = output
        assert final is not None and final.finished
        choices = [ChatCompletionResponseChoice(
            index=sample.index, message=ChatResponseMessage(content=sample.text),
            logprobs=self._logprobs(sample, params), finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason) for sample in final.outputs]
        num_generated = sum(len(sample.token_ids) for sample in final.outputs)
        return ChatCompletionResponse(
            id=request_id, model=model, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                            total_tokens=num_prompt_tokens + num_generated))

    async def _stream(self, stream: AsyncIterator[RequestOutput], request_id: str, model: str,
                      params: SamplingParams, num_prompt_tokens: int,
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice],
                  usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                    choices=choices, usage=usage))

        finished: set[int] = set()
        num_generated = 0
        try:
            for index in range(params.n):
                yield chunk([ChatCompletionStreamChoice(
                    index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for _, output in merge_streams([stream]):
                for sample in output.outputs:
                    if sample.index in finished:
                        continue
                    if not sample.text and not sample.token_ids and sample.finish_reason is None:
                        continue
                    num_generated += len(sample.token_ids)
                    if sample.finish_reason is not None:
                        finished.add(sample.index)
                    delta = DeltaMessage(content=sample.text) if sample.text else DeltaMessage()
                    yield chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=delta,
                        logprobs=self._logprobs(sample, params),
                        finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)])
            if include_usage:
                yield chunk([], UsageInfo(prompt_tokens=num_prompt_tokens,
                                          completion_tokens=num_generated,
                                          total_tokens=num_prompt_tokens + num_generated))
        except Exception as exc:
            yield sse_error(exc)
        yield SSE_DONE
