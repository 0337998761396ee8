"""Where `moemesh up --set` settings go: `FIELD=VALUE` to every service whose config has
that field, `ROLE.FIELD=VALUE` to one role's services only. A field no service has is an
error here, before anything starts. Pure: no I/O."""

from __future__ import annotations

from dataclasses import fields

from moemesh.shared.config.loader import ConfigFileError

ROLES = ("gateway", "prefill", "decode", "kv_store", "balancer")


def config_classes() -> dict[str, type]:
    from moemesh.services.balancer.config import BalancerConfig
    from moemesh.services.decode.config import DecodeConfig
    from moemesh.services.gateway.config import GatewayConfig
    from moemesh.services.kv_store.config import KVStoreConfig
    from moemesh.services.prefill.config import PrefillConfig

    return {"gateway": GatewayConfig, "prefill": PrefillConfig, "decode": DecodeConfig,
            "kv_store": KVStoreConfig, "balancer": BalancerConfig}


def route_settings(items: list[str] | tuple[str, ...], classes: dict[str, type] | None = None
                   ) -> dict[str, tuple[str, ...]]:
    """role -> the FIELD=VALUE settings its services get, in the order given."""
    classes = classes or config_classes()
    known = {role: {f.name for f in fields(cls)} for role, cls in classes.items()}
    out: dict[str, list[str]] = {role: [] for role in classes}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigFileError(f"--set expects FIELD=VALUE or ROLE.FIELD=VALUE, got {item!r}")
        role, dot, name = key.strip().rpartition(".")
        name = name.replace("-", "_")
        if dot:
            if role not in classes:
                raise ConfigFileError(f"--set {item!r}: no role {role!r}; roles: {', '.join(classes)}")
            if name not in known[role]:
                raise ConfigFileError(f"--set {item!r}: {role} has no setting {name!r}")
            out[role].append(f"{name}={value}")
            continue
        takers = [r for r in classes if name in known[r]]
        if not takers:
            raise ConfigFileError(f"--set {item!r}: no service has a setting {name!r}")
        for r in takers:
            out[r].append(f"{name}={value}")
    return {role: tuple(v) for role, v in out.items()}
