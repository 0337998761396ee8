"""`moemesh gateway|prefill|decode`: run one service in the foreground."""

from __future__ import annotations

import argparse
import importlib

SERVICES = {
    "gateway": ("services.gateway.config:GatewayConfig", "services.gateway.service:GatewayService"),
    "prefill": ("services.prefill.config:PrefillConfig", "services.prefill.service:PrefillService"),
    "decode": ("services.decode.config:DecodeConfig", "services.decode.service:DecodeService"),
    "balancer": ("services.balancer.config:BalancerConfig", "services.balancer.service:BalancerService"),
    "kv_store": ("services.kv_store.config:KVStoreConfig", "services.kv_store.service:KVStoreService"),
}


def _load(path: str):
    mod, name = path.split(":")
    return getattr(importlib.import_module(mod), name)


def register(sub) -> None:
    from shared.service.cli import add_arguments

    for name, (cfg_path, _) in SERVICES.items():
        p = sub.add_parser(name, help=f"run the {name} service")
        add_arguments(p, _load(cfg_path))
        p.set_defaults(func=run, service=name)


def run(args: argparse.Namespace) -> int:
    from shared.service.cli import service_main

    cfg_path, svc_path = SERVICES[args.service]
    return service_main(args.service, _load(cfg_path), _load(svc_path), args=args)
