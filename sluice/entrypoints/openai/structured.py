"""The request fields that constrain a reply, as one StructuredOutputsParams.

Sources, one per request at most (two are a 400 naming the second):
- OpenAI's `response_format`: `{"type": "json_object"}` (any JSON object) or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`; `{"type": "text"}`
  is the neutral value;
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object":
  ..., "disable_any_whitespace": bool}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- chat's `tool_choice: "required"` or a named function (`tool_call_constraint`): the reply is
  one or more calls in the tool parser's format (tool_parsers.py; hermes's for parsers that
  have none), each call's arguments valid for its tool's `parameters` schema (one call, of
  that function, when named; one when `parallel_tool_calls` is false), and nothing else.

The grammar itself is checked (compiled without the tokenizer) by the serving code before the
request goes to the engine; its errors name the source field.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from sluice.entrypoints.openai.errors import OpenAIError
from sluice.entrypoints.openai.protocol import ChatTool, NamedToolChoice, SamplingFields
from sluice.entrypoints.openai.tool_parsers import HermesToolParser, ToolParser, ToolSpec
from sluice.sampling_params import StructuredOutputsParams


def structured_outputs_from_request(request: SamplingFields
                                    ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field it came from), or (None, None)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if request.response_format is not None:
        params = _from_response_format(request.response_format)
        if params is not None:
            found.append((params, "response_format"))
    if request.structured_outputs is not None:
        found.append((_convert(request.structured_outputs, "structured_outputs"),
                      "structured_outputs"))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append((_convert({kind: value}, name), name))
    if len(found) > 1:
        raise OpenAIError(f"{found[1][1]} cannot be combined with {found[0][1]}: a request "
                          "takes one structured-output constraint", 400, found[1][1])
    return found[0] if found else (None, None)


def tool_call_constraint(tools: list[ChatTool], tool_choice: str | NamedToolChoice,
                         parallel_tool_calls: bool, parser: type[ToolParser] | None
                         ) -> tuple[StructuredOutputsParams, type[ToolParser]]:
    """The constraint of `tool_choice` "required" or a named function (see the module), in the
    format of `parser` (None: hermes), and the parser that reads the reply."""
    named = isinstance(tool_choice, NamedToolChoice)
    if named:
        chosen = [tool for tool in tools if tool.function.name == tool_choice.function.name]
        if not chosen:
            raise OpenAIError(f"tool_choice names the function {tool_choice.function.name!r}, "
                              f"which is not among the tools "
                              f"{[tool.function.name for tool in tools]}", 400, "tool_choice")
        tools = chosen[:1]
    specs = [ToolSpec(tool.function.name, tool.function.parameters or {"type": "object"})
             for tool in tools]
    single = named or not parallel_tool_calls
    fmt = None if parser is None else parser.constraint(specs, single)
    if fmt is None:
        parser = HermesToolParser
        fmt = parser.constraint(specs, single)
    tag = {"type": "structural_tag", "format": fmt}
    return StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False)), parser


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise OpenAIError(f"response_format must be an object, got {json.dumps(value)[:80]}",
                          400, "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise OpenAIError("response_format of type json_schema needs a json_schema object "
                              "(name, schema)", 400, "response_format")
        schema = spec.get("schema", spec.get("json_schema"))  # vLLM accepts either name
        if not isinstance(schema, (dict, bool)):
            raise OpenAIError("response_format.json_schema.schema must be a JSON schema "
                              f"object, got {json.dumps(schema)[:80]}", 400, "response_format")
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        return StructuredOutputsParams(json=schema)
    raise OpenAIError(f"response_format type {json.dumps(kind)} is not supported; use text, "
                      "json_object or json_schema", 400, "response_format")


def _convert(value: Any, field: str) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise OpenAIError(f"{field} must be an object, got {json.dumps(value)[:80]}", 400,
                          field)
    try:
        return msgspec.convert(value, StructuredOutputsParams)
    except (msgspec.ValidationError, ValueError) as exc:
        message = str(exc).removeprefix("structured_outputs")
        raise OpenAIError(f"{field}: {message.lstrip(': .')}", 400, field) from None
