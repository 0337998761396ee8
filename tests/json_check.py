"""Checks that a text is JSON valid under a schema: with `jsonschema` or `jsonschema_rs`
when installed, else by the keys and types of a flat object schema."""

from __future__ import annotations

import json


def validate(text: str, schema: dict) -> dict:
    """The parsed object; raises (json's ValueError, or an AssertionError) when invalid."""
    obj = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(obj, schema)
        return obj
    try:
        import jsonschema_rs
    except ImportError:
        jsonschema_rs = None
    if jsonschema_rs is not None:
        jsonschema_rs.validate(schema, obj)
        return obj
    types = {"string": str, "boolean": bool, "integer": int, "number": (int, float), "object": dict, "array": list}
    assert isinstance(obj, dict)
    assert set(schema.get("required", [])) <= obj.keys()
    for k, v in obj.items():
        assert k in schema["properties"] or schema.get("additionalProperties", True) is not False
        if k in schema["properties"]:
            assert isinstance(v, types[schema["properties"][k]["type"]])
    return obj
