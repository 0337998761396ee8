"""GrammarSpec -> the grammar-constrained decoding library's own grammar, and its checks.

The library is llguidance (docs/structured_outputs.md says why). This module is the only
place that knows its grammar format; it imports no torch, so the gateway uses it to refuse
a bad schema with a 400 before the request reaches a worker.

JSON is generated compact but readable: `{"a": 1, "b": [2, 3]}`, with no free whitespace.
A JSON grammar that allows any run of whitespace lets a model (a weak or a random one
especially) fill its whole budget with newlines inside a valid but unfinished object.
"""

from __future__ import annotations

import json

from llguidance import LLMatcher, LLTokenizer

from moemesh.shared.protocol.messages import GrammarSpec

# The JSON compiler's options, as llguidance reads them from a schema's "x-guidance" key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """A spec the library cannot compile; the text says what is wrong with it."""


def json_schema_block(schema: dict) -> str:
    """A schema as an embeddable `%json {...}` block of a Lark grammar, with the compact
    JSON options (the gateway's tool-call grammars embed each function's parameters)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def to_library(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (a JSON string). Raises GrammarError."""
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.text)
    schema = ANY_OBJECT if spec.kind == "json_object" or not spec.text else _schema(spec.text)
    try:
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(str(e)) from None


def check(spec: GrammarSpec, tokenizer: LLTokenizer | None = None) -> str:
    """Compile and validate the spec; returns the library grammar. Raises GrammarError
    naming what the library refused (an unknown type, an unsupported keyword, ...)."""
    grammar = to_library(spec)
    is_error, msgs = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(msgs[0] if msgs else "invalid grammar")
    return grammar


def _schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"the schema is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    return schema
