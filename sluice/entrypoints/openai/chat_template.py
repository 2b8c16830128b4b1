"""Chat templates rendered safely: request-supplied templates only when the server trusts them,
every template in a worker thread with a time bound, in transformers' sandboxed Jinja.

A chat template is a program. The model's own template is the operator's choice; a template sent
in a request (`chat_template`, or `chat_template_kwargs.chat_template`) is the client's code and
is refused unless the server runs with `--trust-request-chat-template` (as vLLM does since
CVE-2025-61620). Either kind runs in transformers' `ImmutableSandboxedEnvironment` (no attribute
escapes, no mutation of the inputs), off the event loop, and is stopped once it has rendered for
longer than its time bound: a trace function on the rendering thread checks the deadline at
every line the compiled template runs (Jinja compiles a template to Python code named
`<template>`), so even an output-free nested loop ends.

What the bound does not cover: a single C-level operation that allocates without end (a huge
string repetition). Those need a template from someone the operator trusts, which is what the
flag says.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from types import FrameType
from typing import Any

# Compiled Jinja templates run as Python code under this file name.
_TEMPLATE_FILENAME = "<template>"


class TemplateTimeout(Exception):
    """The chat template rendered for longer than its time bound."""


class TemplateKwargsError(ValueError):
    """A chat_template_kwargs key that collides with a parameter of the renderer."""


def _reserved_kwargs() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    names = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    return frozenset(names - {"self", "kwargs"} | {"conversations", "messages"})


_RESERVED: frozenset[str] | None = None


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """chat_template_kwargs are template variables (`enable_thinking`, ...), not the renderer's
    own parameters (`tokenize`, `tools`, ...): those are refused, naming the key."""
    global _RESERVED
    if _RESERVED is None:
        _RESERVED = _reserved_kwargs()
    for key in kwargs:
        if key in _RESERVED and key != "chat_template":
            raise TemplateKwargsError(
                f"chat_template_kwargs.{key} is not a template variable (it is set by the "
                "request's own fields)")


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it names no file but reads as a
    Jinja template; ValueError for anything else (a mistyped path, say)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")


def _deadline_tracer(deadline: float) -> Any:
    def in_template(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeout
        return in_template

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == _TEMPLATE_FILENAME:
            return in_template(frame, event, arg)
        return None  # no line events outside the template (the tokenizer runs at full speed)

    return on_call


def render_chat_ids(tokenizer: Any, conversation: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None, documents: list[dict[str, Any]] | None,
                    chat_template: str | None, add_generation_prompt: bool,
                    continue_final_message: bool, template_kwargs: dict[str, Any],
                    timeout_s: float) -> list[int]:
    """The conversation rendered and tokenized (as `LLM.chat` does it), in the calling thread,
    which must be a worker thread: the trace function is set for it alone. Raises
    TemplateTimeout past `timeout_s`, and whatever the template raises."""
    previous = sys.gettrace()
    sys.settrace(_deadline_tracer(time.monotonic() + timeout_s))
    try:
        token_ids = tokenizer.apply_chat_template(
            conversation, tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=True, return_dict=False,
            **template_kwargs)
    finally:
        sys.settrace(previous)
    if hasattr(token_ids, "keys"):
        token_ids = token_ids["input_ids"]
    return list(token_ids)
