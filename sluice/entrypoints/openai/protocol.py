"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests ignore fields they do not know (clients send vendor extras) and refuse NaN and
infinity. Types are checked here; value ranges are checked by `SamplingParams`, whose
ValueError names the field (see errors.py), so the limits live in one place. The few bounds set
here keep values representable on the engine wire (int64 / uint64).

Fields of OpenAI's API (and vLLM's extras) that sluice does not implement are declared all the
same, in each request's `UNSUPPORTED`: set to anything but their neutral value they are refused
with a 400 naming them (`unsupported_field`), never silently ignored. Fields that only label a
request (`user`, `metadata`, `service_tier`, `prompt_cache_key`, `safety_identifier`) change
nothing in the output and are accepted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

# A seed fans out to seed + i for `n` samples; keep every one within int64.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
_INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=_INT32_MAX)]
_StrictTokenId = Annotated[int, Field(strict=True)]  # the range: _ids_in_range


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---- errors ----------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared ----------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(num_prompt_tokens: int, num_generated: int, num_cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                     total_tokens=num_prompt_tokens + num_generated,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


def _is_none(value: Any) -> bool:
    return value is None


def _is_falsy(value: Any) -> bool:
    return not value


_NOT_YET = "is not supported yet"


# field -> (is the value neutral?, why it is refused otherwise)
_SAMPLING_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "guided_decoding_backend": (lambda v: v in (None, "xgrammar", "auto"),
                                "is not supported: the one backend is 'xgrammar'"),
    "guided_whitespace_pattern": (_is_none, _NOT_YET + " (structured_outputs' "
                                            "disable_any_whitespace makes JSON compact)"),
    "use_beam_search": (_is_falsy, _NOT_YET),
    "length_penalty": (lambda v: v is None or v == 1.0, _NOT_YET + " (no beam search)"),
    "allowed_token_ids": (_is_none, _NOT_YET),
    "bad_words": (_is_falsy, _NOT_YET),
    "truncate_prompt_tokens": (_is_none, _NOT_YET),
    "return_tokens_as_token_ids": (_is_falsy, _NOT_YET),
    "logits_processors": (_is_falsy, _NOT_YET),
    "spaces_between_special_tokens": (lambda v: v is None or v is True, _NOT_YET),
    "cache_salt": (_is_none, _NOT_YET),
    "priority": (_is_falsy, _NOT_YET + " (one scheduling policy: first come, first served)"),
    "vllm_xargs": (_is_none, _NOT_YET),
}


def unsupported_field(request: BaseModel) -> tuple[str, str] | None:
    """(field, message) of the first unsupported field the request sets, or None."""
    table: dict[str, tuple[Callable[[Any], bool], str]] = getattr(request, "UNSUPPORTED", {})
    for name, (neutral, why) in table.items():
        value = getattr(request, name)
        if not neutral(value):
            shown = json.dumps(value)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            return name, f"{name} {why}; got {shown}"
    return None


class SamplingFields(OpenAIBaseModel):
    """The sampling fields completions and chat completions share (OpenAI's and vLLM's)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    seed: Annotated[int, Field(ge=_SEED_MIN, le=_SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    user: str | None = None
    # Structured outputs (see structured.py): OpenAI's and vLLM's fields.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=_INT32_MAX)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(le=_INT32_MAX)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # vLLM's: logprobs of every prompt token

    UNSUPPORTED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = _SAMPLING_UNSUPPORTED
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    logits_processors: Any = None
    spaces_between_special_tokens: Any = None
    cache_salt: Any = None
    priority: Any = None
    # For the engine's KV connector (vLLM's field); checked by OpenAIServing.kv_transfer_params.
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


# ---- completions -----------------------------------------------------------------------------


def _ids_in_range(ids: list[int]) -> list[int]:
    low, high = min(ids), max(ids)
    if low < 0 or high > _INT32_MAX:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is out of range (0 to {_INT32_MAX})")
    return ids


class CompletionRequest(SamplingFields):
    # Checked left to right, token ids strict (a list of strings never reads as ids): the
    # default "smart" union validates every member, 2.7 ms for 8k ids against 0.4.
    prompt: Annotated[str | list[_StrictTokenId] | list[str] | list[list[_StrictTokenId]],
                      Field(union_mode="left_to_right")]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. around a text prompt

    UNSUPPORTED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_SAMPLING_UNSUPPORTED,
        "suffix": (_is_falsy, _NOT_YET),
        "prompt_embeds": (_is_none, _NOT_YET),
    }
    suffix: Any = None
    prompt_embeds: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_shape(cls, prompt: Any) -> Any:
        # One clear message instead of one per member of the union.
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt:
            kinds = set(map(type, prompt))  # a pass in C: 8k ids in ~0.3 ms
            if kinds == {str}:
                return prompt
            if kinds == {int}:
                return _ids_in_range(prompt)
            if all(isinstance(p, list) and p and set(map(type, p)) == {int} for p in prompt):
                for p in prompt:
                    _ids_in_range(p)
                return prompt
        raise ValueError("must be a string, a list of strings, a list of token ids or a list "
                         "of lists of token ids (none empty)")


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's entry of `prompt_logprobs`: token id (a JSON key) -> this."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first is None: nothing precedes it), token id -> PromptLogprob.
PromptLogprobsList = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- chat completions ------------------------------------------------------------------------


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result answers this call
    reasoning_content: str | None = None  # an assistant's earlier reasoning

    def text(self) -> str:
        """The content as one string: text parts joined, other parts refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"messages: content parts of type {part.type!r} are not "
                                 "supported; only 'text'")
            texts.append(part.text)
        return "\n".join(texts)

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it. Tool-call arguments are handed over as the
        JSON object they spell (Qwen's and Llama's templates print them with `tojson`), or as
        the string where they are not one."""
        entry: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            entry["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise ValueError(f"messages: tool_calls belong to assistant messages, not "
                                 f"{self.role!r} ones")
            entry["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name,
                "arguments": _json_object_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        if self.role == "tool":
            if self.tool_call_id is None:
                raise ValueError("messages: a message of role 'tool' needs the tool_call_id "
                                 "of the call it answers")
            entry["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            entry["reasoning_content"] = self.reasoning_content
        return entry


def _json_object_or_text(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatInputs(OpenAIBaseModel):
    """What renders a conversation into a prompt (chat completions and /tokenize)."""

    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    documents: list[dict[str, Any]] | None = None  # for RAG templates
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: extend the last (assistant) message
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # template variables (enable_thinking)


class ChatCompletionRequest(SamplingFields, ChatInputs):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: False drops reasoning_content

    UNSUPPORTED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_SAMPLING_UNSUPPORTED,
        "functions": (_is_none, "(deprecated by OpenAI) is not supported: use tools"),
        "function_call": (_is_none, "(deprecated by OpenAI) is not supported: use tool_choice"),
        "audio": (_is_none, _NOT_YET),
        "modalities": (lambda v: v is None or v == ["text"], _NOT_YET + " (text only)"),
        "prediction": (_is_none, _NOT_YET),
        "web_search_options": (_is_none, _NOT_YET),
        "reasoning_effort": (_is_none, _NOT_YET + " (use chat_template_kwargs, e.g. "
                                                  "enable_thinking)"),
        "verbosity": (_is_none, _NOT_YET),
        "store": (_is_falsy, _NOT_YET + " (nothing is stored)"),
        "echo": (_is_falsy, _NOT_YET + " in chat completions"),
        "mm_processor_kwargs": (_is_none, _NOT_YET),
    }
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    echo: Any = None
    mm_processor_kwargs: Any = None


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsList | None = None


class _DropNone(OpenAIBaseModel):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """OpenAI's streamed tool call: `index` says which call of the message; the first delta of
    a call carries its id, type and name, later ones continue its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_DropNone):
    """Unset parts are left out: a role-only chunk has no content key, and a chunk for a token
    whose text is held back (a partial character, a possible stop string) is `{}`."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenize, detokenize ------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sluice"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(ChatInputs):
    """Either `prompt` (text, tokenized with special tokens unless told otherwise) or
    `messages` (rendered with the chat template, as a chat completion would)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
