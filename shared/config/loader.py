"""Build a service's config dataclass from one TOML file, the environment and the CLI.

Precedence, lowest first: dataclass defaults, the file's [common] table, the file's
table for this service (e.g. [decode]), environment variables MOEMESH_<FIELD> and
MOEMESH_<SERVICE>_<FIELD>, then `--set field=value` overrides from the command line.
Values from the environment and CLI are strings and are converted to the field's type.
Unknown keys are errors, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


class ConfigFileError(ValueError):
    pass


def read_toml(path: str | Path | None) -> dict[str, Any]:
    if not path:
        return {}
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigFileError(f"{p}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"{p}: not valid TOML ({e})") from None


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigFileError(f"--set expects field=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip().replace("-", "_")] = v
    return out


def load(
    cls: type[T],
    section: str,
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    doc = read_toml(config_file)
    values: dict[str, Any] = {}
    for table in ("common", section):
        part = doc.get(table, {})
        if not isinstance(part, dict):
            raise ConfigFileError(f"{config_file}: [{table}] must be a table")
        for k, v in part.items():
            if isinstance(v, dict):
                continue  # sub-tables belong to other readers (e.g. [decode.pools])
            key = k.replace("-", "_")
            if key not in fields:
                if table == "common":
                    continue  # [common] serves every service; each takes what it knows
                raise ConfigFileError(f"{config_file}: [{table}] has unknown key {k!r}")
            values[key] = _coerce(v, hints[key], f"[{table}] {k}")
    for prefix in ("MOEMESH_", f"MOEMESH_{section.upper()}_"):
        for name in fields:
            env = f"{prefix}{name.upper()}"
            if env in environ:
                values[name] = _coerce(environ[env], hints[name], env)
    for k, v in (overrides or {}).items():
        if k not in fields:
            raise ConfigFileError(f"unknown setting {k!r} for {section}; known: {', '.join(sorted(fields))}")
        values[k] = _coerce(v, hints[k], f"--set {k}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigFileError(f"{section} config: {e}") from None


def _coerce(v: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None or (isinstance(v, str) and v.lower() in ("", "none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(v, inner[0], where)
    try:
        if tp is bool:
            if isinstance(v, bool):
                return v
            if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(v, str) and v.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(v)
        if tp is int:
            if isinstance(v, bool):
                raise ValueError(v)
            return int(v)
        if tp is float:
            return float(v)
        if tp is str:
            return str(v)
        if origin in (tuple, list):
            items = v.split(",") if isinstance(v, str) else list(v)
            items = [x for x in items if x != ""]
            return tuple(_coerce(x, args[0], where) for x in items)
    except (TypeError, ValueError):
        raise ConfigFileError(f"{where}: cannot use {v!r} as {getattr(tp, '__name__', tp)}") from None
    return v
