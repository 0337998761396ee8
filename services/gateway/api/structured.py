"""`response_format` -> the grammar a request's tokens are sampled under.

    {"type": "text"}                      no constraint
    {"type": "json_object"}               any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}

The schema is compiled here once (shared/grammar/compile.py, no tokenizer needed), so a
schema the library cannot enforce is a 400 naming `response_format` before any worker
sees the request. `strict: false` is enforced all the same: a constraint that holds is
what a client asking for a schema wants, and OpenAI's own non-strict mode promises less.
"""

from __future__ import annotations

import json
import re

from moemesh.shared.grammar.compile import GrammarError, check
from moemesh.shared.protocol.messages import MAX_GRAMMAR_CHARS, GrammarSpec

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FormatError(ValueError):
    """What is wrong with a response_format, for a 400 naming it. code: set when the
    schema is well formed but the library cannot enforce it."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def grammar_of(fmt) -> GrammarSpec | None:
    """The request's response_format (already JSON-decoded) as a GrammarSpec, None for
    text. Raises FormatError."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise FormatError("must be an object with a 'type' of text, json_object or json_schema")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        spec = GrammarSpec("json_object")
    elif kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise FormatError("'json_schema' must be an object with a 'name' and a 'schema'")
        name = js.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FormatError("'json_schema.name' must be 1-64 letters, digits, '_' or '-'")
        if not isinstance(js.get("strict", False), (bool, type(None))):
            raise FormatError("'json_schema.strict' must be a boolean")
        schema = js.get("schema")
        if schema is None:  # OpenAI lets it out: any object
            spec = GrammarSpec("json_object")
        elif not isinstance(schema, dict):
            raise FormatError("'json_schema.schema' must be a JSON Schema object")
        else:
            text = json.dumps(schema)
            if len(text) > MAX_GRAMMAR_CHARS:
                raise FormatError(f"'json_schema.schema' is over {MAX_GRAMMAR_CHARS} characters")
            spec = GrammarSpec("json_schema", text)
    else:
        raise FormatError(f"type {kind!r} is not one of text, json_object, json_schema")
    try:
        check(spec)
    except GrammarError as e:
        raise FormatError(f"the schema cannot be enforced: {e}", "unenforceable_schema") from None
    return spec
