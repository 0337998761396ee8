"""Command-line front for every service: `python -m moemesh.services.<name>` and `moemesh <name>`.

Flags become config overrides; the config dataclass is built once here and passed
down. Common flags have their own options; anything else goes through --set.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from typing import Any, Callable

from moemesh.shared.config.common import default_worker_id
from moemesh.shared.config.loader import ConfigFileError, load, parse_overrides
from moemesh.shared.model.config import ConfigError as ModelConfigError

_FLAGS = {  # the settings common enough for a flag of their own; --set reaches every other
    "model": "model directory (config.json, safetensors, tokenizer.json)",
    "nats_url": "NATS server URL(s), comma-separated (default nats://127.0.0.1:4222)",
    "worker_id": "this process's id in the mesh; also its NATS user with per-worker credentials",
    "trace_file": "write this service's spans to this JSON-lines file",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "host": "address to listen on",
    "port": "port to listen on (0: any free port)",
    "served_model_name": "the model name clients send (default: the model directory's name)",
    "subject_prefix": "first token of every NATS subject (default mm); meshes sharing a server differ here",
}


def add_arguments(p: argparse.ArgumentParser, config_cls: type) -> None:
    names = {f.name for f in fields(config_cls)}
    p.add_argument("--config", help="TOML deployment file; this service reads its own table")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any setting of this service's config (repeatable; see README for the list)")
    for name, help_ in _FLAGS.items():
        if name in names:
            p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=help_)


def build_config(args: argparse.Namespace, section: str, config_cls: type) -> Any:
    overrides = parse_overrides(args.set)
    for name in _FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            overrides[name] = v
    cfg = load(config_cls, section, args.config, overrides)
    if not cfg.worker_id and section != "gateway":
        cfg = replace(cfg, worker_id=default_worker_id(section))
    return cfg


def service_main(section: str, config_cls: type, make_service: Callable[[Any], Any],
                 argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        p = argparse.ArgumentParser(prog=f"moemesh {section}")
        add_arguments(p, config_cls)
        args = p.parse_args(argv)
    # Here, not at the top: `moemesh`'s parser reads add_arguments for every service, and
    # nats-py (aiohttp with it) would cost each command, --help included, 0.4 s to import.
    from moemesh.shared.service.lifecycle import configure_logging, run
    from moemesh.shared.service.nats_io import NatsUnreachable

    try:
        cfg = build_config(args, section, config_cls)
    except (ConfigFileError, ValueError) as e:
        print(f"moemesh {section}: error: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log_level)
    try:
        run(lambda: make_service(cfg), cfg.drain_timeout_s)
    except (NatsUnreachable, ModelConfigError) as e:  # one line, not a traceback: the cause is outside
        print(f"moemesh {section}: error: {e}", file=sys.stderr)
        return 1
    return 0
