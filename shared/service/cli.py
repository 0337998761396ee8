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
from moemesh.shared.service.lifecycle import configure_logging, run

_FLAGS = ("model", "nats_url", "worker_id", "trace_file", "log_level", "host", "port", "served_model_name",
          "subject_prefix")


def add_arguments(p: argparse.ArgumentParser, config_cls: type) -> None:
    names = {f.name for f in fields(config_cls)}
    p.add_argument("--config", help="TOML deployment file; this service reads its own table")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any setting (see README for the list)")
    for name in _FLAGS:
        if name in names:
            p.add_argument("--" + name.replace("_", "-"), dest=name, default=None)


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
    try:
        cfg = build_config(args, section, config_cls)
    except (ConfigFileError, ValueError) as e:
        print(f"moemesh {section}: error: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log_level)
    run(lambda: make_service(cfg), cfg.drain_timeout_s)
    return 0
