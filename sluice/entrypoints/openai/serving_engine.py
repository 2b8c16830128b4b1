"""What completions and chat completions share: model names, prompt checks against the context,
SamplingParams from a request, merging several request streams, Server-Sent Events, and ending
a request when its client goes away.

A request is checked in full before anything reaches the engine (the model name, every
prompt's length, the sampling parameters), so a bad request is a 400 that costs the engine
nothing, and a streamed response never starts with a 200 only to fail on its parameters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from sluice.engine.async_llm import AsyncLLM, EngineDeadError
from sluice.entrypoints.openai.chat_template import (
    TemplateKwargsError,
    TemplateTimeout,
    check_template_kwargs,
    render_chat_ids,
)
from sluice.entrypoints.openai.errors import OpenAIError, error_body
from sluice.entrypoints.openai.protocol import ChatInputs, SamplingFields, unsupported_field
from sluice.entrypoints.openai.structured import structured_outputs_from_request
from sluice.entrypoints.openai.text_inputs import TextInputs, encode_ids, lone_surrogate
from sluice.kv_transfer.disagg import params as pd_params
from sluice.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.structured_output.grammar import GrammarError

logger = logging.getLogger("sluice")

T = TypeVar("T")

MAX_N = 128
# JSON has no -inf; a token the model rules out gets this logprob, as in vLLM.
MIN_LOGPROB = -9999.0
SSE_DONE = "data: [DONE]\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(exc: Exception) -> str:
    """The event a stream ends with when the request fails after the 200 went out."""
    if isinstance(exc, OpenAIError):
        status = exc.status
    elif isinstance(exc, EngineDeadError):
        status = 503
    elif isinstance(exc, ValueError):
        status = 400
    else:
        logger.error("a stream failed", exc_info=exc)
        status = 500
    return f"data: {json.dumps(error_body(status, str(exc)))}\n\n"


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """What the serving code takes from the server's flags (see ServerArgs)."""

    log_requests: bool = False
    max_log_len: int | None = None
    trust_request_chat_template: bool = False
    chat_template: str | None = None  # the server's template (--chat-template); None: the model's
    chat_template_timeout_s: float = 10.0
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class OpenAIServing:
    """The engine and the served model names, and the checks every generating route runs."""

    def __init__(self, engine: AsyncLLM, served_model_names: Sequence[str],
                 options: ServingOptions | None = None) -> None:
        assert served_model_names
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.max_model_len = engine.max_model_len
        self.options = options or ServingOptions()
        self.log_requests = self.options.log_requests
        self.max_log_len = self.options.max_log_len
        self.text_inputs = TextInputs(engine.tokenizer, engine.max_model_len)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise OpenAIError(f"The model `{requested}` does not exist. Served models: "
                              f"{self.served_model_names}", 404, "model")
        return requested

    def check_engine(self) -> None:
        error = self.engine.dead_error
        if error is not None:
            raise OpenAIError(f"the engine is dead: {error}", 503)

    async def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool = True,
                              param: str = "prompt", check_size: bool = True,
                              need_text: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt, tokenized (or, given ids, decoded) off the event
        loop. With `check_size`, a text prompt that certainly cannot fit the context is
        refused by its size before any tokenizing; `param` names the prompt in errors
        ("prompt[2]"). Given ids and not `need_text`, the text is None: decoding an 8k-token
        prompt costs milliseconds on the path to its first token."""
        inputs = self.text_inputs
        if isinstance(prompt, str):
            bad = lone_surrogate(prompt, param)
            if bad:
                raise OpenAIError(bad, 400, "prompt")
            if not prompt:
                raise OpenAIError(f"{param} must be a non-empty string, got ''", 400, "prompt")
            num_bytes = inputs.too_long(prompt) if check_size else None
            if num_bytes is not None:
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, your prompt is {num_bytes} bytes long, more than "
                    f"{self.max_model_len} tokens of this tokenizer can hold "
                    f"({inputs.max_prompt_bytes} bytes). Please reduce the length of the "
                    "prompt.", 400, "prompt")
            token_ids = await inputs.run(encode_ids, self.engine.tokenizer, prompt,
                                         add_special_tokens)
            if not token_ids:
                raise OpenAIError(f"{param} tokenized to no tokens", 400, "prompt")
            return prompt, token_ids
        try:
            _, token_ids = self.engine.input_processor.tokenize(list(prompt))
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, "prompt") from None
        if not need_text:
            return None, token_ids
        return await inputs.run(self.engine.tokenizer.decode, token_ids), token_ids

    async def tokenize_chat(self, request: ChatInputs, tools: list[dict[str, Any]] | None
                            ) -> list[int]:
        """The messages rendered with the chat template and tokenized, off the event loop and
        within the template time bound; a template sent in the request needs the server's
        trust (see chat_template.py)."""
        messages = request.messages
        if not messages:
            raise OpenAIError("messages must not be empty", 400, "messages")
        kwargs = dict(request.chat_template_kwargs or {})
        template = request.chat_template
        if "chat_template" in kwargs:
            param = "chat_template_kwargs"
            template = kwargs.pop("chat_template")
        else:
            param = "chat_template"
        if template is not None and not self.options.trust_request_chat_template:
            raise OpenAIError(
                f"{param}: chat templates sent in a request are refused: the server was not "
                "started with --trust-request-chat-template", 400, param)
        if template is not None and not isinstance(template, str):
            raise OpenAIError(f"{param}: the chat template must be a string", 400, param)
        try:
            check_template_kwargs(kwargs)
            conversation = [message.to_template() for message in messages]
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, "chat_template_kwargs"
                              if isinstance(exc, TemplateKwargsError) else "messages") from None
        for value, name in ((conversation, "messages"), (tools, "tools"),
                            (request.documents, "documents"), (kwargs, "chat_template_kwargs"),
                            (template, param)):
            bad = lone_surrogate(value, name)
            if bad:
                raise OpenAIError(bad, 400, name)
        timeout_s = self.options.chat_template_timeout_s
        try:
            token_ids = await self.text_inputs.run(
                render_chat_ids, self.engine.tokenizer, conversation, tools=tools,
                documents=request.documents, chat_template=template or self.options.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=kwargs, timeout_s=timeout_s)
        except TemplateTimeout:
            raise OpenAIError(f"the chat template took longer than {timeout_s:g} s to render",
                              400, param if template is not None else "messages") from None
        except Exception as exc:  # the template runs the user's messages: any failure is theirs
            raise OpenAIError(f"messages: the chat template failed: {exc}", 400,
                              "messages") from None
        if not token_ids:
            raise OpenAIError("messages rendered to an empty prompt", 400, "messages")
        return token_ids

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """400 when the prompt, with the tokens asked for, does not fit the context."""
        limit = self.max_model_len
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"request has {num_prompt_tokens} input tokens. Please reduce the length "
                    "of the input messages.", 400, "messages")
            return
        if num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.", 400, "max_tokens")

    def sampling_params(self, request: SamplingFields, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        tool_constraint: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """The request's SamplingParams; ValueErrors become 400s naming the field, and so do
        fields sluice does not implement (see protocol.py). `tool_constraint`: chat's
        tool_choice required / named (structured.py), which no other constraint may join."""
        refused = unsupported_field(request)
        if refused is not None:
            name, message = refused
            raise OpenAIError(message, 400, name)
        if request.n > MAX_N:
            raise OpenAIError(f"n must be an integer in [1, {MAX_N}], got {request.n}", 400, "n")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError(f"best_of must equal n ({request.n}) or be left out: only "
                              f"parallel sampling is supported, got {request.best_of}", 400,
                              "best_of")
        structured, source = structured_outputs_from_request(request)
        if tool_constraint is not None:
            if structured is not None:
                raise OpenAIError(f"{source} cannot be combined with tool_choice required or "
                                  "a named function: both constrain the reply", 400, source)
            structured = tool_constraint
        try:
            return SamplingParams(
                n=request.n,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=0 if request.top_k is None else request.top_k,
                min_p=0.0 if request.min_p is None else request.min_p,
                seed=request.seed,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=(1.0 if request.repetition_penalty is None
                                    else request.repetition_penalty),
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                logit_bias=_logit_bias(request.logit_bias),
                structured_outputs=structured,
            )
        except ValueError as exc:
            raise OpenAIError.from_value_error(exc, set(type(request).model_fields)) from None

    async def check_constraints(self, request: SamplingFields, params: SamplingParams) -> None:
        """400 for logit_bias ids outside the vocabulary and for a schema, regex, grammar or
        tool parameters schema that does not compile (built off the event loop), naming the
        request field it came from."""
        if not params.logit_bias and params.structured_outputs is None:
            return
        try:
            await self.text_inputs.run(self.engine.input_processor.check_constraints, params)
        except GrammarError as exc:
            _, source = structured_outputs_from_request(request)
            source = source or "tools"
            raise OpenAIError(f"{source}: {exc}", 400, source) from None
        except ValueError as exc:
            raise OpenAIError.from_value_error(exc, set(type(request).model_fields)) from None

    def kv_transfer_params(self, request: SamplingFields, num_prompts: int
                           ) -> dict[str, Any] | None:
        """The request's kv_transfer_params for the engine's KV connector (an object or
        null). The prefill/decode instruction in them (sluice/kv_transfer/disagg/params.py)
        names one transfer: one prompt and one sample only."""
        params = request.kv_transfer_params
        try:
            instruction = pd_params.parse(params)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, "kv_transfer_params") from None
        if instruction is not None and (num_prompts != 1 or request.n != 1):
            raise OpenAIError("kv_transfer_params for prefill/decode disaggregation name one "
                              f"transfer: one prompt and n = 1, got {num_prompts} prompt(s) "
                              f"and n = {request.n}", 400, "kv_transfer_params")
        return params

    def log_request(self, request_id: str, prompt: str | None, token_ids: list[int],
                    params: SamplingParams) -> None:
        if not self.log_requests:
            return
        limit = self.max_log_len
        shown_prompt = prompt if prompt is None or limit is None else prompt[:limit]
        shown_ids = token_ids if limit is None else token_ids[:limit]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                    request_id, shown_prompt, params, shown_ids)


def _logit_bias(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids as JSON strings."""
    if not value:
        return None
    result = {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise OpenAIError(f"logit_bias keys must be token ids (integers), got {key!r}",
                              400, "logit_bias") from None
        result[token_id] = bias
    return result


_END = object()


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index. Closing or
    cancelling the merged stream closes every source (which aborts their requests)."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await _close(streams[0])
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _END))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # each cancelled generate aborts its request synchronously


async def _close(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
