"""POST /v1/chat/completions: the messages rendered with the chat template (with the generation
prompt, the request's `tools` and template variables), then one engine request with `n`
samples.

`max_completion_tokens` wins over `max_tokens`; with neither, a reply may fill the context.
`logprobs: true` returns the chosen token's logprob, plus `top_logprobs` alternatives.
Streamed: first one role chunk per choice (`{"role": "assistant", "content": ""}`), then
deltas, the last of a choice with its finish_reason, the usage chunk if asked for, and
`data: [DONE]`.

A reply's text goes through the server's parsers, in this order: the reasoning parser
(`--reasoning-parser`) takes its thinking into `reasoning_content`; the tool-call parser
(`--tool-call-parser`, when the request has tools and `tool_choice` is `auto`, the default with
tools) takes its calls into `tool_calls` (finish_reason `tool_calls` where it would be `stop`).
Streamed, they are `delta.reasoning_content` and `delta.tool_calls`. `tool_choice: "none"`
still shows the tools to the template but parses no calls.

`tool_choice: "required"` and a named function constrain the reply with the structured-output
engine to calls in the format of the server's `--tool-call-parser` (hermes's for none, and for
parsers without a format of their own) whose arguments are valid for the tools' parameters
schemas (structured.py; no other flag needed): that parser then reads them like `auto`'s calls
(finish_reason `tool_calls` for required, `stop` for a named function, as OpenAI). A reply cut
off by max_tokens inside a call shows no markup: its content is null. A constrained
reply (these, or response_format / structured outputs) skips the reasoning parser: the grammar
starts at the reply's first token, so it has no thinking to split off.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sluice.engine.processors import RequestOutputKind
from sluice.entrypoints.openai.connection import run_until_disconnected
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    usage,
)
from sluice.entrypoints.openai.reasoning import REASONING_PARSERS, Qwen3ReasoningParser
from sluice.entrypoints.openai.serving_completion import vllm_prompt_logprobs
from sluice.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    clamp_logprob,
    merge_streams,
    random_id,
    sse,
    sse_error,
)
from sluice.entrypoints.openai.structured import tool_call_constraint
from sluice.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from sluice.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from sluice.sampling_params import MAX_LOGPROBS, SamplingParams

# Prompt tokens decoded to see whether the prompt leaves the model inside a <think>.
_PROMPT_TAIL_TOKENS = 16  # "<think>" may be several tokens of a vocabulary without it


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


@dataclass(frozen=True, slots=True)
class _Parsing:
    """Which parsers a request's replies go through."""

    reasoning: type[Qwen3ReasoningParser] | None
    prompt_opens_reasoning: bool
    include_reasoning: bool
    tools: type[ToolParser] | None
    parallel_tool_calls: bool
    named_function: bool = False  # a forced function ends with finish_reason "stop"


@dataclass(slots=True)
class _Reply:
    """One choice's parsers and what they have produced so far."""

    parsing: _Parsing
    reasoning_parser: Qwen3ReasoningParser | None = None
    tool_parser: ToolParser | None = None
    num_calls: int = 0
    content: str = ""
    reasoning: str = ""
    reasoned: bool = False  # the reply had reasoning (shown or not)
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.parsing.reasoning is not None:
            self.reasoning_parser = self.parsing.reasoning(self.parsing.prompt_opens_reasoning)
        if self.parsing.tools is not None:
            self.tool_parser = self.parsing.tools()

    def feed(self, text: str, last: bool, truncated: bool = False) -> DeltaMessage:
        """The delta of the next `text` (`last`: the reply ends with it; `truncated`: cut off
        at max_tokens)."""
        reasoning, content = "", text
        if self.reasoning_parser is not None:
            parsed = self.reasoning_parser.feed(text)
            if last:
                tail = self.reasoning_parser.finish()
                parsed.reasoning += tail.reasoning
                parsed.content += tail.content
            reasoning, content = parsed.reasoning, parsed.content
        calls: list[ToolCall] = []
        if self.tool_parser is not None:
            parsed_calls = self.tool_parser.feed(content)
            if last:
                tail_calls = self.tool_parser.finish(truncated)
                parsed_calls.content += tail_calls.content
                parsed_calls.calls += tail_calls.calls
            content, calls = parsed_calls.content, parsed_calls.calls
            if not self.parsing.parallel_tool_calls:
                calls = calls[:max(0, 1 - self.num_calls)]
        self.reasoned = self.reasoned or bool(reasoning)
        if not self.parsing.include_reasoning:
            reasoning = ""
        delta = DeltaMessage(
            content=content or None, reasoning_content=reasoning or None,
            tool_calls=[DeltaToolCall(index=self.num_calls + i, id=call.id, type=call.type,
                                      function=DeltaFunctionCall(name=call.function.name,
                                                                 arguments=call.function.arguments))
                        for i, call in enumerate(calls)] or None)
        self.num_calls += len(calls)
        self.content += content
        self.reasoning += reasoning
        self.calls += calls
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.calls and not self.parsing.named_function:
            return "tool_calls"
        return reason

    def message(self) -> ChatResponseMessage:
        parsed = self.reasoning_parser is not None or self.tool_parser is not None
        content: str | None = self.content
        dropped = self.tool_parser is not None and self.tool_parser.dropped_block
        if parsed and not content and (self.calls or self.reasoned or dropped):
            content = None
        return ChatResponseMessage(content=content, reasoning_content=self.reasoning or None,
                                   tool_calls=self.calls)


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        options = serving.options
        self.reasoning_parser = (None if options.reasoning_parser is None
                                 else REASONING_PARSERS[options.reasoning_parser])
        self.tool_parser = (None if options.tool_call_parser is None
                            else TOOL_PARSERS[options.tool_call_parser])

    def _tool_parser(self, request: ChatCompletionRequest) -> type[ToolParser] | None:
        """The parser of this request's tool calls when tool_choice is auto (None: none
        parsed); 400 for a tool_choice this server cannot honour."""
        choice = request.tool_choice
        if not request.tools:
            if choice not in (None, "none"):
                raise OpenAIError("tool_choice needs tools", 400, "tool_choice")
            return None
        if choice == "none":
            return None
        options = self.serving.options
        if not options.enable_auto_tool_choice or self.tool_parser is None:
            raise OpenAIError('"auto" tool choice (the default with tools) requires the server '
                              "to run with --enable-auto-tool-choice and --tool-call-parser",
                              400, "tool_choice")
        return self.tool_parser

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
        if request.stream and request.prompt_logprobs is not None:
            raise OpenAIError("prompt_logprobs is not supported with stream in chat "
                              "completions", 400, "prompt_logprobs")
        max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                      else request.max_tokens)
        forced = request.tools and request.tool_choice not in (None, "none", "auto")
        tool_constraint = None
        if forced:
            tool_constraint, tool_parser = tool_call_constraint(
                request.tools, request.tool_choice, request.parallel_tool_calls,
                self.tool_parser)
        else:
            tool_parser = self._tool_parser(request)
        params = serving.sampling_params(request, max_tokens, num_logprobs,
                                         request.prompt_logprobs, tool_constraint)
        if tool_parser is not None and not tool_parser.skip_special_tokens:
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        await serving.check_constraints(request, params)
        tools = (None if not request.tools
                 else [tool.model_dump(exclude_none=True) for tool in request.tools])
        token_ids = await serving.tokenize_chat(request, tools)
        serving.check_context(len(token_ids), max_tokens)
        kv_transfer_params = serving.kv_transfer_params(request, 1)
        opens_reasoning = False
        reasoning_parser = self.reasoning_parser
        if params.structured_outputs is not None:
            reasoning_parser = None  # the grammar leaves no room for thinking
        if reasoning_parser is not None:
            tail = serving.engine.tokenizer.decode(token_ids[-_PROMPT_TAIL_TOKENS:])
            opens_reasoning = reasoning_parser.prompt_opens_reasoning(tail)
        parsing = _Parsing(reasoning=reasoning_parser,
                           prompt_opens_reasoning=opens_reasoning,
                           include_reasoning=request.include_reasoning, tools=tool_parser,
                           parallel_tool_calls=request.parallel_tool_calls,
                           named_function=bool(forced) and request.tool_choice != "required")

        request_id = random_id("chatcmpl")
        serving.log_request(request_id, None, token_ids, params)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        stream = serving.engine.generate({"prompt_token_ids": token_ids}, params, request_id,
                                         kind, kv_transfer_params=kv_transfer_params)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                self._stream(stream, request_id, model, params, parsing, len(token_ids),
                             include_usage),
                media_type="text/event-stream")
        response = await run_until_disconnected(
            raw_request, self._full(stream, request_id, model, params, parsing, len(token_ids),
                                    request.prompt_logprobs))
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
                    params: SamplingParams, parsing: _Parsing, num_prompt_tokens: int,
                    num_prompt_logprobs: int | None) -> ChatCompletionResponse:
        final = None
        async for _, output in merge_streams([stream]):
            final = output
        assert final is not None and final.finished
        choices = []
        for sample in final.outputs:
            reply = _Reply(parsing)
            reply.feed(sample.text, last=True, truncated=sample.finish_reason == "length")
            choices.append(ChatCompletionResponseChoice(
                index=sample.index, message=reply.message(),
                logprobs=self._logprobs(sample, params),
                finish_reason=reply.finish_reason(sample.finish_reason),
                stop_reason=sample.stop_reason))
        num_generated = sum(len(sample.token_ids) for sample in final.outputs)
        prompt_logprobs = None
        if num_prompt_logprobs is not None and final.prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(final.prompt_token_ids, final.prompt_logprobs,
                                                   num_prompt_logprobs)
        return ChatCompletionResponse(
            id=request_id, model=model, choices=choices,
            usage=usage(num_prompt_tokens, num_generated, final.num_cached_tokens),
            prompt_logprobs=prompt_logprobs)

    async def _stream(self, stream: AsyncIterator[RequestOutput], request_id: str, model: str,
                      params: SamplingParams, parsing: _Parsing, num_prompt_tokens: int,
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice],
                  usage_info: object = None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                    choices=choices, usage=usage_info))

        replies = [_Reply(parsing) for _ in range(params.n)]
        finished: set[int] = set()
        num_generated = 0
        num_cached = 0
        try:
            for index in range(params.n):
                yield chunk([ChatCompletionStreamChoice(
                    index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for _, output in merge_streams([stream]):
                num_cached = output.num_cached_tokens
                for sample in output.outputs:
                    if sample.index in finished:
                        continue
                    if not sample.text and not sample.token_ids and sample.finish_reason is None:
                        continue
                    num_generated += len(sample.token_ids)
                    last = sample.finish_reason is not None
                    if last:
                        finished.add(sample.index)
                    reply = replies[sample.index]
                    delta = reply.feed(sample.text, last, sample.finish_reason == "length")
                    yield chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=delta,
                        logprobs=self._logprobs(sample, params),
                        finish_reason=reply.finish_reason(sample.finish_reason),
                        stop_reason=sample.stop_reason)])
            if include_usage:
                yield chunk([], usage(num_prompt_tokens, num_generated, num_cached))
        except Exception as exc:
            yield sse_error(exc)
        yield SSE_DONE
