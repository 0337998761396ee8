"""`moemesh up`: bring a whole local mesh up in the foreground; Ctrl-C stops it all."""

from __future__ import annotations

import argparse
import signal
import sys
import time


def register(sub) -> None:
    # Defaults of None mean "not given": the --config file's value, else UpConfig's default, applies.
    p = sub.add_parser("up", help="start NATS, a gateway, a prefill and a decode worker")
    p.add_argument("--config", default="", metavar="FILE",
                   help="deployment TOML: pools from [pools], NATS and model from [common]; every service reads it")
    p.add_argument("--model", default=None, help="model directory (default: a tiny random model, made on first use)")
    p.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
    p.add_argument("--host", default=None, help="gateway address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="gateway port (default 8000); gateway i listens on PORT + i")
    p.add_argument("--gateways", type=int, default=None, help="number of gateways (default 1)")
    p.add_argument("--prefill", type=int, default=None, help="number of prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=None, help="number of decode instances (default 1)")
    p.add_argument("--dep", type=int, default=None, help="ranks per decode instance (wide expert parallelism)")
    p.add_argument("--prefill-dep", type=int, default=None, help="ranks per prefill instance")
    p.add_argument("--redundant", type=int, default=None, help="redundant expert slots per rank")
    p.add_argument("--kv-store", action="store_true", default=None,
                   help="start the KV store (prefix reuse across workers)")
    p.add_argument("--balancer", action=argparse.BooleanOptionalAction, default=None,
                   help="start the expert balancer (default: when an instance is expert-parallel)")
    p.add_argument("--log-dir", default="", help="where each service's log goes (default: a new folder "
                                                 "under ~/.cache/moemesh/runs)")
    p.add_argument("--trace-file", default="", help="write every service's spans to this JSON-lines file")
    p.add_argument("--set", action="append", default=[], metavar="[ROLE.]FIELD=VALUE",
                   help="a setting for every service that has FIELD (e.g. --set max_num_seqs=32, "
                        "--set log_level=DEBUG), or for one role's services only "
                        "(--set gateway.max_inflight=64; roles: gateway, prefill, decode, kv_store, balancer)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The launch settings: the --config file's, with every flag that was given on top."""
    from moemesh.tools.launch.settings import route_settings
    from moemesh.tools.launch.up import up_config

    sets = route_settings(args.set)
    return up_config(args.config, model=args.model, nats_url=args.nats_url, host=args.host, port=args.port,
                     num_prefill=args.prefill, num_decode=args.decode, decode_dp=args.dep,
                     num_gateways=args.gateways,
                     prefill_dp=args.prefill_dep, eplb_redundant=args.redundant, balancer=args.balancer,
                     kv_store=args.kv_store, log_dir=args.log_dir, prefill_args=sets["prefill"],
                     decode_args=sets["decode"], gateway_args=sets["gateway"], kv_store_args=sets["kv_store"],
                     balancer_args=sets["balancer"], trace_file=args.trace_file)


def run(args: argparse.Namespace) -> int:
    from moemesh.shared.config.loader import ConfigFileError
    from moemesh.tools.launch.nats_server import NatsServerNotFound
    from moemesh.tools.launch.up import Mesh

    try:
        cfg = config_from_args(args)
    except ConfigFileError as e:
        print(f"moemesh up: error: {e}", file=sys.stderr)
        return 2
    stop = False

    def on_signal(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        mesh = Mesh(cfg)
        print(f"starting moemesh (logs in {mesh.log_dir}) ...", flush=True)
        with mesh:
            print(f"moemesh is up: {'  '.join(mesh.urls)}  (model {mesh.model}, NATS {mesh.nats_url})")
            name = mesh.model.rstrip("/").split("/")[-1]
            print(f"try:\n  curl -N {mesh.url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                  f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
                  f"\"stream\": true, \"max_tokens\": 32}}'")
            print("Ctrl-C stops everything.", flush=True)
            while not stop:
                try:
                    restarted = mesh.supervise()
                except RuntimeError as e:
                    print(f"moemesh: {e}\nstopping", file=sys.stderr)
                    return 1
                if restarted:
                    print(f"moemesh: {', '.join(restarted)} exited; started again (logs in {mesh.log_dir})",
                          file=sys.stderr, flush=True)
                time.sleep(0.2)
            print("stopping ...", flush=True)
    except (NatsServerNotFound, RuntimeError, TimeoutError) as e:
        print(f"moemesh up: error: {e}", file=sys.stderr)
        return 1
    print("stopped.")
    return 0
