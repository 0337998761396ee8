"""Typed messages on the wire: dataclasses <-> MessagePack, validated on decode.

A message class is a dataclass whose fields are annotated with plain types: int,
float, str, bytes, bool, None-able versions, list[...], dict[str, ...] and nested
message classes. `decode(data, Cls)` checks every field against its annotation and
raises ProtocolError with the field path on the first mismatch, so a handler never
meets a KeyError or a wrong type deep inside its logic.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import lru_cache
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class ProtocolError(ValueError):
    """A message that does not match its schema; the text names the field."""


# Hot-path messages may register a compact codec (positional arrays, hand-checked), so
# a per-token message costs about a microsecond rather than a generic walk of its fields.
_CODECS: dict[type, tuple[Any, Any]] = {}


def register_codec(cls: type, to_plain, from_plain_fn) -> None:
    """to_plain(obj) -> msgpack-able value; from_plain_fn(raw) -> obj, raising ProtocolError."""
    _CODECS[cls] = (to_plain, from_plain_fn)


def encode(msg: Any) -> bytes:
    codec = _CODECS.get(type(msg))
    return msgpack.packb(codec[0](msg) if codec else _to_plain(msg), use_bin_type=True)


def decode(data: bytes, cls: type[T]) -> T:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"{cls.__name__}: not valid MessagePack ({type(e).__name__}: {e})") from None
    codec = _CODECS.get(cls)
    if codec is not None:
        return codec[1](raw)
    return from_plain(raw, cls)


def from_plain(raw: Any, cls: type[T], path: str = "") -> T:
    return _convert(raw, cls, path or cls.__name__)


def _to_plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v):
        return {f.name: _to_plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_to_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_plain(x) for k, x in v.items()}
    return v


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@lru_cache(maxsize=None)
def _required(cls: type) -> frozenset[str]:
    return frozenset(
        f.name for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )


def _convert(v: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(v, a, path)
            except ProtocolError as e:
                errors.append(str(e))
        raise ProtocolError(errors[0] if errors else f"{path}: unexpected null")
    if dataclasses.is_dataclass(tp):
        if not isinstance(v, dict):
            raise ProtocolError(f"{path}: expected an object, got {type(v).__name__}")
        missing = _required(tp) - v.keys()
        if missing:
            raise ProtocolError(f"{path}: missing field {sorted(missing)[0]!r}")
        hints = _hints(tp)
        kw = {k: _convert(x, hints[k], f"{path}.{k}") for k, x in v.items() if k in hints}
        try:
            return tp(**kw)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"{path}: {e}") from None
    if origin in (list, tuple):
        if not isinstance(v, (list, tuple)):
            raise ProtocolError(f"{path}: expected a list, got {type(v).__name__}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        out = [_convert(x, item, f"{path}[{i}]") for i, x in enumerate(v)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(v, dict):
            raise ProtocolError(f"{path}: expected an object, got {type(v).__name__}")
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {_convert(k, kt, f"{path}.<key>"): _convert(x, vt, f"{path}.{k}") for k, x in v.items()}
    if tp is Any:
        return v
    if tp is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    elif tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    elif tp is bool:
        if isinstance(v, bool):
            return v
    elif tp in (str, bytes):
        if isinstance(v, tp):
            return v
    else:
        raise ProtocolError(f"{path}: unsupported annotation {tp!r}")
    raise ProtocolError(f"{path}: expected {tp.__name__}, got {type(v).__name__}")
