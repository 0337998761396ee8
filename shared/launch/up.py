"""`moemesh up`: one NATS server, one gateway, one prefill and one decode worker.

States: starting NATS -> making the model (if none given) -> starting workers and the
gateway -> waiting for readiness -> serving -> stopping (reverse order, SIGTERM first).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.launch.nats_server import start_nats
from shared.launch.procs import ProcessGroup, free_port

log = logging.getLogger(__name__)


def default_home() -> Path:
    return Path(os.environ.get("MOEMESH_HOME", Path.home() / ".cache" / "moemesh"))


@dataclass(frozen=True)
class UpConfig:
    model: str = ""  # empty: the tiny model, made on first use
    nats_url: str = ""  # empty: start a nats-server
    host: str = "127.0.0.1"
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    decode_dp: int = 1  # ranks per decode instance (DEP-N); each rank is a worker
    prefill_dp: int = 1
    eplb_redundant: int = 0  # redundant expert slots per rank
    balancer: bool | None = None  # None: start one when an instance is expert-parallel
    balancer_args: tuple[str, ...] = ()  # --set arguments for the balancer
    log_dir: str = ""
    ready_timeout_s: float = 180.0
    service_args: tuple[str, ...] = ()  # extra --set arguments for every worker
    prefill_args: tuple[str, ...] = ()  # ... for prefill workers only
    decode_args: tuple[str, ...] = ()  # ... for decode workers only
    gateway_args: tuple[str, ...] = ()
    trace_file: str = ""
    extra_env: dict = field(default_factory=dict)


def ensure_tiny_model(home: Path) -> Path:
    path = home / "models" / "tiny"
    if not (path / "config.json").is_file():
        from shared.checkpoint.writer import init_model

        log.info("making the tiny model in %s", path)
        init_model(path, "tiny")
    return path


class Mesh:
    """A running local mesh; a context manager that always stops what it started."""

    def __init__(self, cfg: UpConfig):
        self.cfg = cfg
        home = default_home()
        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else home / "runs" / time.strftime("up-%Y%m%d-%H%M%S")
        self.group = ProcessGroup(self.log_dir)
        self.model = cfg.model or str(ensure_tiny_model(home))
        self.nats_url = cfg.nats_url
        self.port = cfg.port

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def __enter__(self) -> "Mesh":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        cfg = self.cfg
        if not self.nats_url:
            port = free_port() if _busy(4222) else 4222
            start_nats(self.group, port)
            self.nats_url = f"nats://127.0.0.1:{port}"
        if self.port == 0:
            self.port = free_port(cfg.host)
        common = ["--model", self.model, "--nats-url", self.nats_url]
        if cfg.trace_file:
            common += ["--trace-file", cfg.trace_file]
        extra = [a for s in cfg.service_args for a in ("--set", s)]
        py = [sys.executable, "-m"]
        for role, n, dp in (("prefill", cfg.num_prefill, cfg.prefill_dp), ("decode", cfg.num_decode, cfg.decode_dp)):
            for i in range(n):
                own = [a for x in (cfg.prefill_args if role == "prefill" else cfg.decode_args) for a in ("--set", x)]
                for argv, name in instance_argv(role, i, dp, cfg.eplb_redundant):
                    self.group.start(name, py + [f"services.{role}", *common, *argv, *extra, *own], cfg.extra_env)
        if cfg.balancer or (cfg.balancer is None and (cfg.decode_dp > 1 or cfg.prefill_dp > 1 or cfg.eplb_redundant)):
            bal = [a for x in cfg.balancer_args for a in ("--set", x)]
            self.group.start("balancer", py + ["services.balancer", "--model", self.model, "--nats-url",
                                               self.nats_url, *bal], cfg.extra_env)
        gw = [a for x in cfg.gateway_args for a in ("--set", x)]
        self.group.start("gateway", py + ["services.gateway", *common, "--host", cfg.host, "--port", str(self.port),
                                          *gw], cfg.extra_env)
        self.wait_ready(cfg.ready_timeout_s)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            dead = self.group.dead()
            if dead:
                c = dead[0]
                raise RuntimeError(f"{c.name} exited with code {c.popen.returncode} during start-up:\n{c.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError as e:
                last = str(e)
            time.sleep(0.25)
        raise TimeoutError(f"mesh not ready after {timeout:.0f}s ({last}); logs in {self.log_dir}")

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.group.stop()


def instance_argv(role: str, index: int, dp: int, redundant: int) -> list[tuple[list[str], str]]:
    """Arguments for each process of one instance: one, or one per DEP rank."""
    if dp == 1 and not redundant:
        return [([], f"{role}-{index}")]
    inst = f"{role}-i{index}"
    init = f"tcp://127.0.0.1:{free_port()}"
    out = []
    for r in range(dp):
        sets = [f"dp_size={dp}", f"dp_rank={r}", f"instance_id={inst}", f"dist_init={init}",
                f"eplb_redundant={redundant}", "expert_parallel=true"]
        out.append((["--worker-id", f"{inst}-r{r}", *[a for x in sets for a in ("--set", x)]], f"{inst}-r{r}"))
    return out


def _busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
