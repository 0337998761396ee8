"""The `moemesh` command. Each subcommand lives in its own module and registers itself
here; arguments are parsed once and turned into config dataclasses in that module."""

from __future__ import annotations

import argparse
import logging
import sys

from moemesh.tools.cli import (cmd_bench, cmd_eplb, cmd_generate, cmd_init_model, cmd_nats_auth, cmd_plan,
                               cmd_profile, cmd_services, cmd_trace, cmd_up)

COMMANDS = [cmd_up, cmd_init_model, cmd_generate, cmd_bench, cmd_trace, cmd_services, cmd_eplb, cmd_profile,
            cmd_nats_auth, cmd_plan]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moemesh")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moemesh", description="Disaggregated serving mesh for MoE models")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level of this command (a service subcommand's own --log-level wins)")
    p.add_argument("--version", action="version", version=f"moemesh {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A service subcommand's own --log-level (None unless given) shadows this one; the
    # service then sets its level from its config (shared/service/lifecycle.py).
    logging.basicConfig(level=args.log_level or "INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns a benchmark's output
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
