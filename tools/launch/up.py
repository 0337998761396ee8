"""`moemesh up`: one NATS server, one gateway, one prefill and one decode worker.

States: starting NATS -> making the model (if none given) -> starting workers and the
gateway -> waiting for readiness -> serving -> stopping (reverse order, SIGTERM first).
While serving, a service that exits is started again (`Mesh.supervise`; a DEP instance
whole), as a deployment's supervisor would; the NATS server started here, or a service
that keeps exiting, stops the mesh.

With `--config FILE` (the deployment file, see compose/moemesh.toml) the pool sizes come
from its [pools] table, the NATS URL and model from [common], the gateway address from
[gateway]; flags still win. Every service is started with `--config FILE` and reads its
own tables, so credentials and settings in the file reach the services unchanged.

Every process gets a fixed worker id (gateway, kv_store, balancer, prefill-0, decode-i0-r1,
...: see `worker_names`), which is also its NATS user name when the mesh runs with
per-worker NATS credentials (tools/launch/nats_auth.py): a process whose
`<ID>_NATS_PASSWORD` (see `password_env`) is set in this environment connects as user ID
with that password, overriding any nats_user of the deployment file.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moemesh.shared.config.loader import ConfigFileError, read_toml
from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port

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
    num_gateways: int = 1  # gateway i listens on port + i
    decode_dp: int = 1  # ranks per decode instance (DEP-N); each rank is a worker
    prefill_dp: int = 1
    eplb_redundant: int = 0  # redundant expert slots per rank
    balancer: bool | None = None  # None: start one when an instance is expert-parallel
    balancer_args: tuple[str, ...] = ()  # --set arguments for the balancer
    kv_store: bool = False
    kv_store_args: tuple[str, ...] = ()
    log_dir: str = ""
    ready_timeout_s: float = 180.0
    nats_probe_s: float = 10.0  # a given nats_url must accept a connection within this
    service_args: tuple[str, ...] = ()  # extra --set arguments for every worker
    prefill_args: tuple[str, ...] = ()  # ... for prefill workers only
    decode_args: tuple[str, ...] = ()  # ... for decode workers only
    gateway_args: tuple[str, ...] = ()
    trace_file: str = ""
    extra_env: dict = field(default_factory=dict)
    config_file: str = ""  # the deployment file, passed to every service as --config


# [pools] key -> UpConfig field. Only `moemesh up` reads this table; services never do.
POOL_KEYS = {"prefill": "num_prefill", "decode": "num_decode", "prefill_dep": "prefill_dp",
             "decode_dep": "decode_dp", "redundant": "eplb_redundant", "balancer": "balancer",
             "kv_store": "kv_store", "gateways": "num_gateways"}


def up_config(config_file: str = "", **flags: Any) -> UpConfig:
    """An UpConfig from the deployment file (if any) and command-line flags.

    Args:
        config_file: TOML deployment file; "" for none.
        flags: UpConfig fields given on the command line; None means "not given", so the
            file's value (or the default) stands.
    Returns:
        The launch settings, with config_file made absolute for the services.
    Raises:
        ConfigFileError: an unreadable file, an unknown [pools] key or a bad value.
    """
    values: dict[str, Any] = {}
    if config_file:
        doc = read_toml(config_file)
        pools = doc.get("pools", {})
        for k, v in pools.items():
            if k not in POOL_KEYS:
                raise ConfigFileError(f"{config_file}: [pools] has unknown key {k!r}; known: {', '.join(POOL_KEYS)}")
            want = bool if k in ("balancer", "kv_store") else int
            if type(v) is not want:
                raise ConfigFileError(f"{config_file}: [pools] {k} must be {want.__name__}, got {v!r}")
            values[POOL_KEYS[k]] = v
        common, gateway = doc.get("common", {}), doc.get("gateway", {})
        for key, table in (("model", common), ("nats_url", common), ("host", gateway), ("port", gateway)):
            if key in table:
                values[key] = table[key]
        values["config_file"] = str(Path(config_file).resolve())
    known = {f.name for f in fields(UpConfig)}
    for k, v in flags.items():
        if k not in known:
            raise TypeError(f"unknown UpConfig field {k!r}")
        if v is not None:
            values[k] = v
    cfg = UpConfig(**values)
    if min(cfg.num_prefill, cfg.num_decode, cfg.eplb_redundant) < 0 \
            or min(cfg.prefill_dp, cfg.decode_dp) < 1:
        raise ConfigFileError("pool sizes must be >= 0 and DEP widths >= 1")
    if cfg.num_gateways < 1:
        raise ConfigFileError("gateways must be >= 1")
    return cfg


@dataclass(frozen=True)
class Launch:
    name: str  # also the process's worker id and, with per-worker credentials, its NATS user
    argv: list[str]  # after `python -m`


@dataclass(frozen=True)
class WorkerName:
    role: str  # gateway | prefill | decode | balancer | kv_store
    worker_id: str
    instance: str = ""  # the DEP instance of a rank; "": the worker is its own instance
    rank: int = 0


def password_env(user: str) -> str:
    """The environment variable that holds user's NATS password: decode-i0-r1 -> DECODE_I0_R1_NATS_PASSWORD."""
    return user.upper().replace("-", "_") + "_NATS_PASSWORD"


def wants_balancer(cfg: UpConfig) -> bool:
    return bool(cfg.balancer or (cfg.balancer is None and (cfg.decode_dp > 1 or cfg.prefill_dp > 1 or cfg.eplb_redundant)))


def worker_names(cfg: UpConfig) -> list[WorkerName]:
    """Every service process of the mesh, in start order: KV store, workers, balancer, gateway.
    Pure: launch_plan starts these, and nats_auth gives each its own NATS user."""
    out = [WorkerName("kv_store", "kv_store")] if cfg.kv_store else []
    for role, n, dp in (("prefill", cfg.num_prefill, cfg.prefill_dp), ("decode", cfg.num_decode, cfg.decode_dp)):
        for i in range(n):
            if dp == 1 and not cfg.eplb_redundant:
                out.append(WorkerName(role, f"{role}-{i}"))
            else:
                out += [WorkerName(role, f"{role}-i{i}-r{r}", f"{role}-i{i}", r) for r in range(dp)]
    if wants_balancer(cfg):
        out.append(WorkerName("balancer", "balancer"))
    out += [WorkerName("gateway", gw) for gw in gateway_ids(cfg.num_gateways)]
    return out


def gateway_ids(n: int) -> list[str]:
    """One gateway is `gateway`, as it always was (its NATS user and token subjects keep
    their names); several are gateway-0 .. gateway-(n-1), numbered like the workers."""
    return ["gateway"] if n == 1 else [f"gateway-{i}" for i in range(n)]


def credentials_env(worker_id: str, environ: dict) -> dict[str, str]:
    """MOEMESH_NATS_USER/PASSWORD for one process, when environ holds its password; else nothing."""
    pw = environ.get(password_env(worker_id))
    return {"MOEMESH_NATS_USER": worker_id, "MOEMESH_NATS_PASSWORD": pw} if pw else {}


def ensure_tiny_model(home: Path) -> Path:
    """The tiny model under home, made on first use. Made in a folder of its own and
    renamed into place whole, so that two launchers starting at once never load a
    half-written checkpoint: the first rename wins and the other copy is dropped."""
    path = home / "models" / "tiny"
    if not (path / "config.json").is_file():
        import shutil
        import tempfile

        from moemesh.shared.checkpoint.writer import init_model

        log.info("making the tiny model in %s", path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=path.parent))
        try:
            init_model(tmp, "tiny")
            try:
                tmp.rename(path)
            except OSError:  # made meanwhile by another launcher (or left half-made before: replace it)
                if not (path / "config.json").is_file():
                    shutil.rmtree(path, ignore_errors=True)
                    tmp.rename(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# `moemesh up` starts a service again when it exits, at most this often, before it gives up.
RESTART_LIMIT = 5
RESTART_WINDOW_S = 600.0
RANK_LEAVE_S = 10.0  # a DEP rank whose peer exited is given this long to leave by itself


class Mesh:
    """A running local mesh; a context manager that always stops what it started."""

    def __init__(self, cfg: UpConfig):
        self.cfg = cfg
        home = default_home()
        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else home / "runs" / time.strftime("up-%Y%m%d-%H%M%S")
        if cfg.model:
            check_model_dir(cfg.model)
        if cfg.port:
            for port in range(cfg.port, cfg.port + cfg.num_gateways):
                check_port_free(cfg.host, port)
        if cfg.nats_url:
            check_nats_reachable(cfg.nats_url, cfg.nats_probe_s)
        self.group = ProcessGroup(self.log_dir)
        self.model = cfg.model or str(ensure_tiny_model(home))
        self.nats_url = cfg.nats_url
        self.port = cfg.port
        self._launches: dict[str, tuple[list[str], dict, tuple]] = {}  # name -> (argv, env, unset), to restart it
        self._instance_of = {w.worker_id: w.instance for w in worker_names(cfg) if w.instance}
        self._restarts: dict[str, list[float]] = {}  # name -> monotonic times it was started again

    @property
    def url(self) -> str:
        """The first gateway's URL."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """Every gateway's URL: gateway i listens on port + i."""
        return [f"http://{self.cfg.host}:{self.port + i}" for i in range(self.cfg.num_gateways)]

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
            self.port = free_ports_from(cfg.host, cfg.num_gateways)
        environ = {**os.environ, **cfg.extra_env}
        # Each process gets its own password only (as MOEMESH_NATS_PASSWORD), never its peers'.
        others = tuple(k for k in environ if k.endswith("_NATS_PASSWORD"))
        for launch in launch_plan(cfg, self.model, self.nats_url, self.port):
            env = {**cfg.extra_env, **credentials_env(launch.name, environ)}
            self._launches[launch.name] = ([sys.executable, "-m", *launch.argv], env, others)
            self.group.start(launch.name, *self._launches[launch.name][:2], unset=others)
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
                # Ready means every gateway answers and every worker started here has
                # joined, not just the first of each role: a test or a benchmark right
                # after start sees them all.
                if all(self._ready(url) for url in self.urls) and self._all_joined():
                    return
            except OSError as e:
                last = str(e)
            time.sleep(0.25)
        raise TimeoutError(f"mesh not ready after {timeout:.0f}s ({last}); logs in {self.log_dir}")

    @staticmethod
    def _ready(url: str) -> bool:
        with urllib.request.urlopen(url + "/health/ready", timeout=2) as r:
            return r.status == 200

    def _all_joined(self) -> bool:
        """Every gateway has heard every worker started here."""
        cfg = self.cfg
        want = {"prefill": cfg.num_prefill * cfg.prefill_dp, "decode": cfg.num_decode * cfg.decode_dp}
        for url in self.urls:
            have = self.health(url).get("workers", {})
            if any(have.get(role, 0) < n for role, n in want.items()):
                return False
        return True

    def health(self, url: str = "") -> dict:
        """A gateway's /health (the first gateway's by default)."""
        with urllib.request.urlopen((url or self.url) + "/health", timeout=2) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.group.stop()

    def supervise(self, now: float | None = None) -> list[str]:
        """Start again the services that exited, as a supervisor would (systemd's
        Restart=on-failure): a DEP instance whole, since a rank whose peer died leaves by
        itself and a restarted rank can only meet all of its peers again.

        Returns:
            The names started again (none: nothing had exited).
        Raises:
            RuntimeError: what cannot come back: the NATS server started here, or a
                process restarted RESTART_LIMIT times within RESTART_WINDOW_S.
        """
        now = time.monotonic() if now is None else now
        latest, dead = self.group.latest(), self.group.dead()
        if not dead:
            return []
        names: set[str] = set()
        for c in dead:
            if c.name not in self._launches:
                raise RuntimeError(f"{c.name} exited (code {c.popen.returncode})\n{c.log_tail()}")
            inst = self._instance_of.get(c.name)
            names |= {n for n, i in self._instance_of.items() if i == inst} if inst else {c.name}
        for n in names:
            recent = [t for t in self._restarts.get(n, []) if now - t < RESTART_WINDOW_S]
            if len(recent) >= RESTART_LIMIT:
                c = latest[n]
                raise RuntimeError(f"{n} exited {len(recent) + 1} times within {RESTART_WINDOW_S:.0f}s; last:\n"
                                   f"{c.log_tail()}")
            self._restarts[n] = recent + [now]
        deadline = time.monotonic() + RANK_LEAVE_S
        for n in names:  # the instance's other ranks: they leave by themselves once a peer is gone
            c = latest[n]
            while c.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            if c.alive():
                c.popen.kill()
                c.popen.wait(10)
        for n in (n for n in self._launches if n in names):  # in start order: rank 0 first
            argv, env, unset = self._launches[n]
            self.group.start(n, argv, env, unset=unset)
        return sorted(names)


def launch_plan(cfg: UpConfig, model: str, nats_url: str, port: int) -> list[Launch]:
    """Every service process of the mesh (worker_names), with its arguments.

    Args:
        cfg: the launch settings.
        model: the model directory every service is given.
        nats_url: the NATS server they all connect to.
        port: the first gateway's HTTP port; gateway i gets port + i.
    """
    common = ["--model", model, "--nats-url", nats_url]
    if cfg.config_file:
        common = ["--config", cfg.config_file, *common]
    traced = common + (["--trace-file", cfg.trace_file] if cfg.trace_file else [])
    extra = _sets(cfg.service_args)
    inits: dict[str, str] = {}  # DEP instance -> the address its ranks meet at
    out = []
    gateway_port = dict(zip(gateway_ids(cfg.num_gateways), range(port, port + cfg.num_gateways)))
    for w in worker_names(cfg):
        me = ["--worker-id", w.worker_id]
        if w.role == "kv_store":
            out.append(Launch(w.worker_id, ["moemesh.services.kv_store", *common, *me, *_sets(cfg.kv_store_args)]))
        elif w.role == "balancer":
            out.append(Launch(w.worker_id, ["moemesh.services.balancer", *common, *me, *_sets(cfg.balancer_args)]))
        elif w.role == "gateway":
            out.append(Launch(w.worker_id, ["moemesh.services.gateway", *traced, *me, "--host", cfg.host,
                                            "--port", str(gateway_port[w.worker_id]),
                                            *_sets(cfg.gateway_args)]))
        else:
            dp = cfg.prefill_dp if w.role == "prefill" else cfg.decode_dp
            own = cfg.prefill_args if w.role == "prefill" else cfg.decode_args
            argv = me + (_rank_sets(w, dp, cfg.eplb_redundant, inits) if w.instance else [])
            out.append(Launch(w.worker_id, [f"moemesh.services.{w.role}", *traced, *argv, *extra, *_sets(own)]))
    return out


def _sets(items) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _rank_sets(w: WorkerName, dp: int, redundant: int, inits: dict[str, str]) -> list[str]:
    """The settings that make w a rank of its DEP instance."""
    if w.instance not in inits:
        inits[w.instance] = f"tcp://127.0.0.1:{free_port()}"
    return _sets([f"dp_size={dp}", f"dp_rank={w.rank}", f"instance_id={w.instance}", f"dist_init={inits[w.instance]}",
                  f"eplb_redundant={redundant}", "expert_parallel=true"])


def check_model_dir(model: str) -> None:
    """A model directory every service can open: a config.json it reads and a tokenizer.
    Checked before anything starts, so a wrong path is one line at once, not a traceback
    from each service later."""
    from moemesh.shared.model.config import ConfigError, ModelConfig

    try:
        ModelConfig.from_dir(model)
    except ConfigError as e:
        raise RuntimeError(f"bad --model: {e}") from None
    if not (Path(model) / "tokenizer.json").is_file():
        raise RuntimeError(f"bad --model: {Path(model) / 'tokenizer.json'}: not found")


def free_ports_from(host: str, n: int, tries: int = 50) -> int:
    """A port p with p .. p+n-1 all free (the gateways listen on consecutive ports)."""
    for _ in range(tries):
        base = free_port(host)
        try:
            for port in range(base + 1, base + n):
                check_port_free(host, port)
        except RuntimeError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports on {host}")


def check_port_free(host: str, port: int) -> None:
    """Fails at once when something already listens on the gateway's port (another mesh's
    gateway would otherwise answer our readiness check)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"port {port} on {host} is already in use ({e.strerror}); "
                               "choose another with --port") from None


def check_nats_reachable(urls: str, timeout_s: float) -> None:
    """Some server of a NATS URL list accepts a TCP connection within timeout_s."""
    import socket
    from urllib.parse import urlsplit

    from moemesh.shared.service.nats_io import redact_url

    deadline = time.monotonic() + timeout_s
    addrs = []
    for u in urls.split(","):
        parts = urlsplit(u.strip() if "://" in u else "nats://" + u.strip())
        try:
            addrs.append((parts.hostname or "127.0.0.1", parts.port or 4222))
        except ValueError:
            raise RuntimeError(f"bad NATS URL {redact_url(u)!r}") from None
    last = ""
    while True:
        for addr in addrs:
            try:
                with socket.create_connection(addr, timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                    return
            except OSError as e:
                last = e.strerror or str(e)
        if time.monotonic() >= deadline:
            raise RuntimeError(f"cannot reach NATS at {redact_url(urls)} within {timeout_s:g}s ({last})")
        time.sleep(0.25)


def _busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
