"""Child processes that are always cleaned up: SIGTERM, a grace period, then SIGKILL.

On Linux each child also asks the kernel to SIGTERM it if its parent dies, so even a
launcher killed with SIGKILL leaves nothing running behind it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the launcher's own cleanup still applies


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, proc: "Child | None" = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with code {proc.popen.returncode}; see {proc.log_path}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f}s")


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path | None = None
    last: bool = False  # infrastructure the others need while they drain (NATS): stopped after them

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@dataclass
class ProcessGroup:
    """Starts children and stops them: all at once, then those marked `last`.

    Stopping one child at a time does not work for the ranks of an expert-parallel
    instance: a rank stops in step with its peers (a collective decides), so a rank
    signalled alone waits for a peer that is only signalled after it has exited."""

    log_dir: Path | None = None
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, last: bool = False,
              unset: tuple[str, ...] = ()) -> Child:
        """env: added to this process's environment; unset: names taken out of the result."""
        out = None
        path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            path = self.log_dir / f"{name}.log"
            out = open(path, "ab")
        full_env = dict(os.environ, **(env or {}))
        for k in unset:
            full_env.pop(k, None)
        try:
            popen = subprocess.Popen(argv, stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT, env=full_env,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        finally:
            if out is not None:
                out.close()
        child = Child(name, popen, path, last)
        self.children.append(child)
        return child

    def stop(self, grace_s: float = 15.0) -> None:
        for wave in ([c for c in self.children if not c.last], [c for c in self.children if c.last]):
            for child in reversed(wave):
                if child.alive():
                    child.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for child in wave:
                while child.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if child.alive():
                    child.popen.kill()
                    child.popen.wait(5)
        self.children.clear()

    def latest(self) -> dict[str, Child]:
        """The newest child of each name: a process started again replaces its old self."""
        return {c.name: c for c in self.children}

    def live(self, name: str) -> Child | None:
        c = self.latest().get(name)
        return c if c is not None and c.alive() else None

    def dead(self) -> list[Child]:
        """The children that exited and were not started again."""
        return [c for c in self.latest().values() if not c.alive()]
