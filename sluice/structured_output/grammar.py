"""What a request's `structured_outputs` asks for, as an xgrammar grammar.

A `GrammarKey` names the grammar of a StructuredOutputsParams (equal keys, equal grammars: the
compile cache's key). `check_structured_outputs` builds the tokenizer-free `xgrammar.Grammar`
to refuse a bad schema, regex or grammar before the request reaches the engine (cached, so the
server's check and the input processor's cost one build); `compile_grammar` compiles it against
one tokenizer's vocabulary, which is what the matchers run on (sluice/structured_output/
manager.py, in the engine core).

Kinds, as in vLLM's xgrammar backend: `json` a JSON schema (xgrammar's strict mode: no
properties beyond the schema's unless it allows them); `json_object` the schema
`{"type": "object"}`; `regex`; `choice` the strings as the alternatives of an EBNF grammar;
`grammar` EBNF in xgrammar's dialect (`root ::= ...`); `structural_tag` xgrammar's structural
tag JSON (how tool calls are constrained, see sluice/entrypoints/openai/structured.py).
`disable_any_whitespace` makes JSON compact (no whitespace between its tokens); otherwise any
whitespace is allowed there, as in vLLM.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from sluice.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ".
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarKey(NamedTuple):
    kind: str
    spec: str  # the schema / regex / grammar / tag as text; the choices as a JSON list
    compact_json: bool  # disable_any_whitespace


class GrammarError(ValueError):
    """The schema, regex or grammar cannot be compiled; the message says why."""


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    kind = params.kind
    if kind == "json":
        value = params.json
        spec = value if isinstance(value, str) else json.dumps(value)
    elif kind == "json_object":
        spec = '{"type": "object"}'
    elif kind == "choice":
        spec = json.dumps(params.choice)
    else:
        spec = getattr(params, kind)
    return GrammarKey(kind, spec, params.disable_any_whitespace)


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """GrammarError (a ValueError) naming the problem, for a grammar xgrammar cannot build."""
    error = _build_error(grammar_key(params))
    if error is not None:
        raise GrammarError(error)


@lru_cache(maxsize=512)
def _build_error(key: GrammarKey) -> str | None:
    try:
        build_grammar(key)
    except GrammarError as exc:
        return str(exc)
    return None


def build_grammar(key: GrammarKey) -> xgrammar.Grammar:
    import xgrammar as xgr

    kind, spec, compact = key
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
            "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}[kind]
    try:
        if kind in ("json", "json_object"):
            try:
                schema = json.loads(spec)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"a JSON schema must be an object, got {spec[:80]}")
            return xgr.Grammar.from_json_schema(spec, any_whitespace=not compact,
                                                separators=(",", ":") if compact else None)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec)
        return xgr.Grammar.from_structural_tag(spec)
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (C++) and pydantic / value errors
        message = _CPP_PREFIX.sub("", str(exc).strip()).strip()
        raise GrammarError(f"invalid {what}: {message}") from None


def compile_grammar(compiler: xgrammar.GrammarCompiler,
                    key: GrammarKey) -> xgrammar.CompiledGrammar:
    """The grammar compiled for the compiler's tokenizer (slow: milliseconds to seconds)."""
    return compiler.compile_grammar(build_grammar(key))


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`, each choice an EBNF string literal."""
    return "root ::= " + " | ".join(f'"{_ebnf_literal(choice)}"' for choice in choices)


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
