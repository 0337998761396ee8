"""`moemesh nats-auth`: write the NATS user table of a deployment, one user per worker."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("nats-auth", help="write nats-server's auth.conf: one user per worker of a deployment")
    p.add_argument("--config", required=True, metavar="FILE", help="deployment TOML; its [pools] name the workers")
    p.add_argument("-o", "--output", default="-", help="where to write it (default: stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.shared.config.loader import ConfigFileError, read_toml
    from moemesh.tools.launch.nats_auth import identities, render_auth_conf
    from moemesh.tools.launch.up import password_env, up_config

    try:
        cfg = up_config(args.config)
        prefix = read_toml(args.config).get("common", {}).get("subject_prefix", "mm")
        users = identities(cfg)
        text = render_auth_conf(users, prefix, args.config)
    except (ConfigFileError, ValueError) as e:
        print(f"moemesh nats-auth: error: {e}", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        # The variables nats-server (and `moemesh up`) read the passwords from.
        print("passwords: " + " ".join(password_env(u.worker_id) for u in users), file=sys.stderr)
    return 0
