"""Tool-call parsers (`--tool-call-parser`): a reply's tool calls apart from its text.

Each parser reads one model family's format and turns each call into OpenAI's
`{"id": "call_...", "type": "function", "function": {"name", "arguments"}}`, its arguments as
JSON text:

- `hermes` (Hermes, Qwen 2.5 / 3): each call a JSON object between tags,
  `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`;
  a block may also hold a JSON list of such objects (the `smollm2` form).
- `smollm2` (SmolLM2, trained on APIGen's format): one block holding a JSON list,
  `<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>`.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): the reply is the call,
  `{"name": "get_weather", "parameters": {"city": "Paris"}}`, after an optional
  `<|python_tag|>`; several are separated by `;`.
- `pythonic` (Llama 3.2 / 4 with Python-list calls): the reply is a Python list of calls with
  keyword arguments, `[get_weather(city="Paris"), get_time(timezone="UTC")]`, optionally
  between `<|python_start|>` and `<|python_end|>`; argument values are Python literals (read
  with `ast.literal_eval`, never evaluated).
- `mistral` (Mistral): `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects
  (tokenizer v3) or `name[ARGS]{...}` per call (tokenizer v11+), to the end of the reply.
  `[TOOL_CALLS]` is a special token: requests parsed with it keep special tokens in the text.

What a parser makes of a reply:
- Text outside the calls is the reply's content; whitespace-only text between or around calls
  is dropped, so a reply of calls alone has no content.
- A block whose text is no call the client could run (not JSON, no name) stays content,
  markup and all, when the model closed it. An unclosed block at the end of the reply is
  parsed as it is (an EOS right after the JSON is a call), and dropped when it does not parse:
  a reply cut off at max_tokens never shows half a call as content.
- The parser is fed text deltas as they stream and yields content text and whole calls: any
  way of cutting the same text gives the same content and calls (the non-streamed reply is the
  one-delta case). A call is sent once complete, in one delta with its id, name and all of its
  arguments (a shape OpenAI's clients accumulate like any other).

`tool_choice` "required" or a named function constrains the reply to the parser's format
(`constraint`, an xgrammar structural tag: every call's arguments valid for its tool's
`parameters`); parsers without one (`pythonic`, `mistral`) are forced in the hermes format.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from sluice.entrypoints.openai.protocol import FunctionCall, ToolCall
from sluice.entrypoints.openai.reasoning import partial_tag_suffix


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> ToolCall:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=tool_call_id(), function=FunctionCall(name=name, arguments=arguments))


def json_calls(value: Any, arguments_key: str = "arguments") -> list[ToolCall] | None:
    """Calls from a decoded JSON object (or list of them) `{"name": ..., "arguments": ...}`;
    None when it is no such thing."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get(arguments_key, item.get("arguments", item.get("parameters", {})))
        calls.append(make_call(item["name"], arguments))
    return calls


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """What a constraint needs of one tool."""

    name: str
    parameters: dict[str, Any]


class ToolParser:
    """Content and calls of a reply whose calls sit in blocks that open with `start_tag` and
    close with `end_tag` (None: a block runs to the end of the reply). Subclasses say how a
    block's text becomes calls (`parse_block`)."""

    name = ""
    start_tag = ""
    end_tag: str | None = None
    skip_special_tokens = True  # False: the format has special tokens the parser must see

    def __init__(self) -> None:
        self._held = ""  # unparsed text: a possible start tag, or an open block's body
        self._in_block = False
        self._pending_space = ""  # trailing whitespace of content, sent once text follows
        self._space_before_block = ""  # given back if the block is no call
        self.num_calls = 0
        self.dropped_block = False  # an unclosed last block that was no call (cut off)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError(type(self).__name__)

    @classmethod
    def constraint(cls, tools: list[ToolSpec], single: bool) -> dict[str, Any] | None:
        """The structural tag of one or more calls of `tools` in this format (`single`: one
        call), or None: the format has none (hermes's is used)."""
        return None

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        buffer = self._held + text
        while True:
            if self._in_block:
                end = -1 if self.end_tag is None else buffer.find(self.end_tag)
                if end < 0:
                    break
                self._close_block(buffer[:end], self.end_tag or "", out)
                buffer = buffer[end + len(self.end_tag or ""):]
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

    def finish(self, truncated: bool = False) -> ToolDelta:
        """What was held back, at the end of the reply (`truncated`: cut off at max_tokens):
        an unclosed last block is parsed, and dropped if it is no call."""
        out = ToolDelta()
        held, self._held = self._held, ""
        if self._in_block:
            self._in_block = False
            calls = self._parse(held)
            if calls:
                self._add_calls(calls, out)
            else:
                self.dropped_block = True
        else:
            self._content(held, out)
        if self.num_calls == 0:
            out.content += self._pending_space
        self._pending_space = ""
        return out

    def _parse(self, body: str) -> list[ToolCall] | None:
        try:
            return self.parse_block(body)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            return None

    def _content(self, text: str, out: ToolDelta) -> None:
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body):]
        out.content += body

    def _close_block(self, body: str, end_tag: str, out: ToolDelta) -> None:
        self._in_block = False
        calls = self._parse(body)
        if calls is None:
            self._pending_space = self._space_before_block
            self._content(self.start_tag + body + end_tag, out)
            return
        self._add_calls(calls, out)

    def _add_calls(self, calls: list[ToolCall], out: ToolDelta) -> None:
        self.num_calls += len(calls)
        out.calls += calls


def _tag(begin: str, parameters: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin,
            "content": {"type": "json_schema", "json_schema": parameters}, "end": end}


def _calls_with_separator(tags: list[dict[str, Any]], separator: str,
                          single: bool) -> dict[str, Any]:
    return {"type": "tags_with_separator", "tags": tags, "separator": separator,
            "at_least_one": True, "stop_after_first": single}


class HermesToolParser(ToolParser):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        return json_calls(json.loads(body))

    @classmethod
    def constraint(cls, tools: list[ToolSpec], single: bool) -> dict[str, Any]:
        tags = [_tag(f'<tool_call>\n{{"name": {json.dumps(tool.name, ensure_ascii=False)}, '
                     '"arguments": ', tool.parameters, "}\n</tool_call>") for tool in tools]
        return _calls_with_separator(tags, "\n", single)


class SmolLM2ToolParser(HermesToolParser):
    name = "smollm2"

    @classmethod
    def constraint(cls, tools: list[ToolSpec], single: bool) -> dict[str, Any]:
        tags = [_tag(f'{{"name": {json.dumps(tool.name, ensure_ascii=False)}, "arguments": ',
                     tool.parameters, "}") for tool in tools]
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": "<tool_call>["},
            _calls_with_separator(tags, ", ", single),
            {"type": "const_string", "value": "]</tool_call>"}]}


class MistralToolParser(ToolParser):
    name = "mistral"
    start_tag = "[TOOL_CALLS]"
    end_tag = None
    skip_special_tokens = False
    _V11_CALL = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]")  # name[ARGS]{...}

    def parse_block(self, body: str) -> list[ToolCall] | None:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        for part in body.split(self.start_tag):  # v11+ may repeat the tag before each call
            part = part.strip()
            if part.startswith("["):  # v3: a JSON list
                found = json_calls(json.loads(part))
                if found is None:
                    return None
                calls += found
                continue
            position = 0
            while position < len(part):
                match = self._V11_CALL.match(part, position)
                if match is None:
                    return None
                arguments, position = decoder.raw_decode(part, match.end())
                calls.append(make_call(match.group(1), arguments))
                while position < len(part) and part[position].isspace():
                    position += 1
        return calls or None


class _WholeReplyToolParser(ToolParser):
    """Formats without tags around the calls: a reply whose first text opens a call (one of
    `opens`) is held to its end and parsed (content if it does not parse, unless it was cut
    off at max_tokens); any other reply is content, streamed as it comes."""

    opens: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # "start" (not known yet) | "calls" | "text"

    def feed(self, text: str) -> ToolDelta:
        if self._mode == "text":
            return ToolDelta(content=text)
        self._held += text
        if self._mode == "start":
            head = self._held.lstrip()
            if not head or (not head.startswith(self.opens)
                            and any(o.startswith(head) for o in self.opens)):
                return ToolDelta()  # too little text to tell
            if head.startswith(self.opens):
                self._mode = "calls"
            else:
                self._mode = "text"
                held, self._held = self._held, ""
                return ToolDelta(content=held)
        return ToolDelta()

    def finish(self, truncated: bool = False) -> ToolDelta:
        held, self._held = self._held, ""
        if self._mode != "calls":
            return ToolDelta(content=held)
        out = ToolDelta()
        calls = self._parse(held)
        if calls:
            self._add_calls(calls, out)
        elif not truncated:
            out.content = held
        else:
            self.dropped_block = True
        return out


class Llama3JsonToolParser(_WholeReplyToolParser):
    name = "llama3_json"
    opens = ("<|python_tag|>", "{")

    def parse_block(self, body: str) -> list[ToolCall] | None:
        body = body.strip().removeprefix("<|python_tag|>").strip()
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        position = 0
        while True:
            value, position = decoder.raw_decode(body, position)
            found = json_calls(value, "parameters")
            if found is None:
                return None
            calls += found
            rest = body[position:].lstrip()
            if not rest.startswith(";"):
                return calls if not rest else None
            rest = rest[1:].lstrip()
            if not rest:
                return calls
            position = len(body) - len(rest)

    @classmethod
    def constraint(cls, tools: list[ToolSpec], single: bool) -> dict[str, Any]:
        tags = [_tag(f'{{"name": {json.dumps(tool.name, ensure_ascii=False)}, "parameters": ',
                     tool.parameters, "}") for tool in tools]
        return _calls_with_separator(tags, "; ", single)


class PythonicToolParser(_WholeReplyToolParser):
    name = "pythonic"
    opens = ("<|python_start|>", "[")

    def parse_block(self, body: str) -> list[ToolCall] | None:
        body = body.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        tree = ast.parse(body.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if (not isinstance(node, ast.Call) or node.args
                    or not isinstance(node.func, (ast.Name, ast.Attribute))
                    or any(kw.arg is None for kw in node.keywords)):  # positional, **kwargs
                return None
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append(make_call(ast.unparse(node.func), arguments))
        return calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, SmolLM2ToolParser, Llama3JsonToolParser,
                                       PythonicToolParser, MistralToolParser)}
