"""`moemesh gateway|prefill|decode`: run one service in the foreground."""

from __future__ import annotations

import argparse
import importlib

SERVICES = {
    "gateway": ("moemesh.services.gateway.config:GatewayConfig", "moemesh.services.gateway.service:GatewayService"),
    "prefill": ("moemesh.services.prefill.config:PrefillConfig", "moemesh.services.prefill.service:PrefillService"),
    "decode": ("moemesh.services.decode.config:DecodeConfig", "moemesh.services.decode.service:DecodeService"),
    "balancer": ("moemesh.services.balancer.config:BalancerConfig", "moemesh.services.balancer.service:BalancerService"),
    "kv_store": ("moemesh.services.kv_store.config:KVStoreConfig", "moemesh.services.kv_store.service:KVStoreService"),
}


def _load(path: str):
    mod, name = path.split(":")
    return getattr(importlib.import_module(mod), name)


def register(sub) -> None:
    from moemesh.shared.service.cli import add_arguments

    for name, (cfg_path, _) in SERVICES.items():
        p = sub.add_parser(name, help=f"run the {name} service")
        add_arguments(p, _load(cfg_path))
        p.set_defaults(func=run, service=name)


def run(args: argparse.Namespace) -> int:
    from moemesh.shared.service.cli import service_main

    cfg_path, svc_path = SERVICES[args.service]
    return service_main(args.service, _load(cfg_path), _load(svc_path), args=args)
