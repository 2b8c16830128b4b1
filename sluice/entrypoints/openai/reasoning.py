"""Reasoning parsers (`--reasoning-parser`): a reply's thinking apart from its answer.

Qwen3 (`qwen3`) thinks inside `<think>...</think>` at the start of its reply, then answers.
The text between the tags is the reply's `reasoning_content`, what follows `</think>` its
`content` (both kept as the model wrote them, whitespace included, as vLLM does). A reply that
does not start with `<think>` is all content (Qwen3 with `enable_thinking: false`), unless the
prompt itself ended inside a `<think>` (templates that open the tag for the model): then the
reply is reasoning up to `</think>`. A reply cut off before `</think>` is all reasoning.

The parser is fed text deltas as they stream; it holds back only what could still be the start
of a tag, so any way of cutting the same text into deltas gives the same two strings, and the
non-streamed reply is the one-delta case.
"""

from __future__ import annotations

from dataclasses import dataclass


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (to hold back)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class Qwen3ReasoningParser:
    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, prompt_opens_reasoning: bool = False) -> None:
        # "start": not yet known whether the reply opens with <think>.
        self._phase = "reasoning" if prompt_opens_reasoning else "start"
        self._held = ""

    @classmethod
    def prompt_opens_reasoning(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` leaves the model inside a `<think>`."""
        tail = prompt_tail.rstrip()
        return tail.endswith(cls.start_tag)

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        buffer = self._held + text
        while True:
            if self._phase == "start":
                if buffer.startswith(self.start_tag):
                    buffer = buffer[len(self.start_tag):]
                    self._phase = "reasoning"
                    continue
                if self.start_tag.startswith(buffer):
                    break  # "" or "<thi": wait for more
                self._phase = "content"
                continue
            if self._phase == "reasoning":
                end = buffer.find(self.end_tag)
                if end >= 0:
                    out.reasoning += buffer[:end]
                    buffer = buffer[end + len(self.end_tag):]
                    self._phase = "content"
                    continue
                keep = partial_tag_suffix(buffer, self.end_tag)
                out.reasoning += buffer[:len(buffer) - keep]
                buffer = buffer[len(buffer) - keep:]
                break
            out.content += buffer
            buffer = ""
            break
        self._held = buffer
        return out

    def finish(self) -> ReasoningDelta:
        """What was held back, at the end of the reply."""
        held, self._held = self._held, ""
        if self._phase == "reasoning":
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
