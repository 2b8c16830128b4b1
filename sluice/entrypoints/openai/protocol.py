"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests ignore fields they do not know (clients send vendor extras) and refuse NaN and
infinity. Types are checked here; value ranges are checked by `SamplingParams`, whose
ValueError names the field (see errors.py), so the limits live in one place. The few bounds set
here keep values representable on the engine wire (int64 / uint64).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

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


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=_INT32_MAX)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(le=_INT32_MAX)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# ---- completions -----------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_shape(cls, prompt: Any) -> Any:
        # One clear message instead of one per member of the union.
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return prompt
            if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
                return prompt
            if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in p) for p in prompt):
                return prompt
        raise ValueError("must be a string, a list of strings, a list of token ids or a list "
                         "of lists of token ids (none empty)")


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


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


class DeltaMessage(OpenAIBaseModel):
    """Unset parts are left out: a role-only chunk has no content key, and a chunk for a token
    whose text is held back (a partial character, a possible stop string) is `{}`."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


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


class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (text, tokenized with special tokens unless told otherwise) or
    `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
