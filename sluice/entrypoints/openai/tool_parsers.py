"""Tool-call parsers (`--tool-call-parser`): a reply's tool calls apart from its text.

`hermes` is the format of Hermes and Qwen models: each call is a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call becomes OpenAI's `{"id": "call_...", "type": "function", "function": {"name",
"arguments"}}`, its arguments as JSON text. A block whose JSON is not such an object stays in
the reply's text, tags and all (the model did not make a call the client could run). A last
block the reply ends inside (an EOS right after the JSON, or max_tokens) is parsed the same way.
Text outside the blocks is the reply's content; whitespace-only text between or around calls
is dropped, so a reply of calls alone has no content.

The parser is fed text deltas as they stream and yields content text and whole calls: any way
of cutting the same text gives the same content and calls (the non-streamed reply is the
one-delta case). A call is sent once its block is closed, in one delta that carries its id,
name and all of its arguments (a shape OpenAI's clients accumulate like any other).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from sluice.entrypoints.openai.protocol import FunctionCall, ToolCall
from sluice.entrypoints.openai.reasoning import partial_tag_suffix


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class HermesToolParser:
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self) -> None:
        self._held = ""  # unparsed text: a possible start tag, or an open block's body
        self._in_block = False
        self._pending_space = ""  # trailing whitespace of content, sent once text follows
        self._space_before_block = ""  # given back if the block is no call
        self.num_calls = 0

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        buffer = self._held + text
        while True:
            if self._in_block:
                end = buffer.find(self.end_tag)
                if end < 0:
                    break
                self._close_block(buffer[:end], self.end_tag, out)
                buffer = buffer[end + len(self.end_tag):]
                continue
            start = buffer.find(self.start_tag)
            if start >= 0:
                self._content(buffer[:start], out)
                self._space_before_block, self._pending_space = self._pending_space, ""
                buffer = buffer[start + len(self.start_tag):]
                self._in_block = True
                continue
            keep = partial_tag_suffix(buffer, self.start_tag)
            self._content(buffer[:len(buffer) - keep], out)
            buffer = buffer[len(buffer) - keep:]
            break
        self._held = buffer
        return out

    def finish(self) -> ToolDelta:
        """What was held back, at the end of the reply: an unclosed last block is parsed."""
        out = ToolDelta()
        held, self._held = self._held, ""
        if self._in_block:
            self._in_block = False
            self._close_block(held, "", out)
        else:
            self._content(held, out)
        if self.num_calls == 0:
            out.content += self._pending_space
        self._pending_space = ""
        return out

    def _content(self, text: str, out: ToolDelta) -> None:
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body):]
        out.content += body

    def _close_block(self, body: str, end_tag: str, out: ToolDelta) -> None:
        self._in_block = False
        call = self._parse(body)
        if call is None:
            self._pending_space = self._space_before_block
            self._content(self.start_tag + body + end_tag, out)
            return
        self.num_calls += 1
        out.calls.append(call)

    @staticmethod
    def _parse(body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(id=tool_call_id(), function=FunctionCall(name=value["name"],
                                                                 arguments=arguments))


TOOL_PARSERS = {"hermes": HermesToolParser}
