"""`moemesh bench rack`: the mesh across three hosts on one machine, and the faults that
hit racks.

The hosts are network namespaces (tools/launch/rack_net.py), each on a control network
(NATS, HTTP, the DEP ranks' agreement) and a data network (UCX). Layout:

    h1  nats-1  gateway  prefill-0
    h2  nats-2  decode-i0-r0  decode-i0-r1      (a DEP2 instance)
    h3  nats-3  decode-1 (or a DEP2 instance)  kv_store

The three NATS servers are one cluster (a full mesh of routes); every service connects
to its own host's node first and lists the other two as fallbacks. UCX runs over TCP on
each host's data0: hosts of a rack share no memory, so the transports that need that are
off even though these "hosts" share a kernel.

Each scenario gets a fresh rack (namespaces and processes), the load client of `bench
chaos` (tools/bench/chaos_client.py, its own process in the root namespace, talking to
the gateway over the control network), and one fault at host granularity once every
stream is generating. The row is the one `bench chaos` reports (tools/bench/chaos_report.py),
judged against this bench's goals. Needs root (network namespaces) and `ip`.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from moemesh.tools.bench import chaos_report as report
from moemesh.tools.bench import rack_moves
from moemesh.tools.bench.chaos import _gateway_counters, _stats_of
from moemesh.tools.bench.chaos_client import ChaosLoad, LoadClient
from moemesh.tools.bench.env import environment
from moemesh.tools.bench.rack_scenarios import SCENARIOS, RackScenario
from moemesh.tools.launch.nats_server import NatsNode, client_urls, start_nats_cluster, start_nats_node
from moemesh.tools.launch.procs import Child, ProcessGroup
from moemesh.tools.launch.rack_net import CTL_DEV, DATA_DEV, Host, RackNetwork
from moemesh.tools.launch.up import default_home, ensure_tiny_model

NATS_PORT, NATS_CLUSTER_PORT, GATEWAY_PORT, DIST_PORT = 4222, 6222, 8000, 29500
BLOCK_SIZE = 16
LEFTOVER_WITHIN_S = 40.0  # after the load: every block and staging byte is back by then


MOVE_TIMEOUT_S = 4.0  # a cut move's ranks drop their staging after this
MOVED_INSTANCE, MOVED_RANKS = "decode-i0", ("decode-i0-r0", "decode-i0-r1")
PULL_SLACK_S = 0.5  # a fetch's wait beyond transfer_timeout_s: the event loop's own delays


@dataclass(frozen=True)
class RackConfig:
    model: str = ""
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    streams: int = 100
    max_tokens: int = 200
    prompt_tokens: int = 64
    ready_tokens: int = 20
    mock_step_ms: float = 20.0
    real: bool = False  # the real tiny model instead of the mock engine
    second_dep: int = 1  # ranks of host 3's decode instance
    deadline_s: float = 30.0
    probe_rate: float = 5.0
    dp_timeout_s: float = 5.0  # every collective of a DEP rank gives up after this
    transfer_timeout_s: float = 3.0
    log_dir: str = ""
    tag: str = "mm"  # names of the namespaces and bridges

    def __post_init__(self) -> None:
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown or not self.scenarios:
            raise ValueError(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
        if self.streams < 2 or self.max_tokens < 2 or not 1 <= self.ready_tokens < self.max_tokens:
            raise ValueError("--streams and --max-tokens must be >= 2, --ready-tokens in [1, max_tokens)")
        if self.second_dep not in (1, 2):
            raise ValueError("--second-dep must be 1 or 2")


@dataclass(frozen=True)
class Proc:
    name: str
    host: str
    argv: list[str]  # after `python -m`
    env: dict


def nats_nodes(hosts: list[Host]) -> list[NatsNode]:
    return [NatsNode(f"nats-{h.name[1:]}", h.ctl_addr, NATS_PORT, NATS_CLUSTER_PORT, h.prefix) for h in hosts]


def plan(cfg: RackConfig, hosts: list[Host], model: str, balancer: list[str] | None = None) -> list[Proc]:
    """Every service process of the rack, with its host and arguments; a balancer (on h1)
    with these settings when `balancer` is given. Pure."""
    h1, h2, h3 = hosts
    nodes = nats_nodes(hosts)
    blocks = -(-(cfg.prompt_tokens + 2 * cfg.max_tokens) // BLOCK_SIZE)
    worker = [] if cfg.real else [
        "engine=mock", f"mock_step_ms={cfg.mock_step_ms}",
        f"max_num_batched_tokens={max(16384, cfg.streams * (cfg.prompt_tokens + cfg.max_tokens))}",
        f"num_kv_blocks={max(8192, 2 * cfg.streams * blocks)}"]
    worker += [f"block_size={BLOCK_SIZE}", f"max_num_seqs={max(2 * cfg.streams, 64)}",
               f"ucx_net_devices={DATA_DEV}", "ucx_tls=tcp", f"transfer_timeout_s={cfg.transfer_timeout_s}"]

    def common(h: Host, wid: str) -> list[str]:
        return ["--model", model, "--nats-url", client_urls(nodes, f"nats-{h.name[1:]}"), "--worker-id", wid]

    def sets(items) -> list[str]:
        return [a for s in items for a in ("--set", s)]

    # gloo (the ranks' agreement) on the control network; UCX alone on the data network.
    dep_env = {"GLOO_SOCKET_IFNAME": CTL_DEV}

    def dep(role: str, h: Host, instance: str, n: int, port: int) -> list[Proc]:
        return [Proc(f"{instance}-r{r}", h.name, [f"moemesh.services.{role}", *common(h, f"{instance}-r{r}"), *sets(
            worker + [f"dp_size={n}", f"dp_rank={r}", f"instance_id={instance}", "expert_parallel=true",
                      f"dist_init=tcp://{h.ctl_addr}:{port}", f"dp_timeout_s={cfg.dp_timeout_s}"])], dep_env)
            for r in range(n)]

    out = [Proc("kv_store", h3.name, ["moemesh.services.kv_store", *common(h3, "kv_store"),
                                      *sets([f"ucx_net_devices={DATA_DEV}", "ucx_tls=tcp"])], {})]
    out.append(Proc("prefill-0", h1.name, ["moemesh.services.prefill", *common(h1, "prefill-0"), *sets(worker)], {}))
    out += dep("decode", h2, "decode-i0", 2, DIST_PORT)
    if cfg.second_dep == 1:
        out.append(Proc("decode-1", h3.name, ["moemesh.services.decode", *common(h3, "decode-1"), *sets(worker)], {}))
    else:
        out += dep("decode", h3, "decode-i1", 2, DIST_PORT)
    if balancer is not None:
        out.append(Proc("balancer", h1.name, ["moemesh.services.balancer", "--model", model, "--nats-url",
                                              client_urls(nodes, "nats-1"), *sets(balancer)], {}))
    out.append(Proc("gateway", h1.name, ["moemesh.services.gateway", *common(h1, "gateway"), "--host", h1.ctl_addr,
                                         "--port", str(GATEWAY_PORT), *sets(
                                             [f"max_inflight={4 * cfg.streams}", "worker_header=true"])], {}))
    return out


def _sets_of(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set" and i + 1 < len(argv))


# ---- a running rack ------------------------------------------------------------------------
class Rack:
    """The namespaces, the NATS cluster and the services of one scenario; a context manager."""

    def __init__(self, cfg: RackConfig, log_dir: Path, model: str, balancer: list[str] | None = None):
        self.cfg, self.log_dir, self.model = cfg, log_dir, model
        self.net = RackNetwork(3, cfg.tag)
        self.nodes = nats_nodes(self.net.hosts)
        self.procs = plan(cfg, self.net.hosts, model, balancer)
        self.group = ProcessGroup(log_dir)
        self.url = f"http://{self.net.hosts[0].ctl_addr}:{GATEWAY_PORT}"
        self.nats_url = client_urls(self.nodes, "nats-1")  # the bench's own, from the root namespace

    def __enter__(self) -> "Rack":
        self.net.__enter__()
        try:
            start_nats_cluster(self.group, self.nodes)
            for p in self.procs:
                self.start(p)
            self._wait_ready(180.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.group.stop()
        finally:
            self.net.__exit__()

    def start(self, p: Proc) -> Child:
        h = self.net.host(p.host)
        return self.group.start(p.name, [*h.prefix, sys.executable, "-m", *p.argv], p.env)

    def restart_nats(self, name: str) -> Child:
        node = next(n for n in self.nodes if n.name == name)
        return start_nats_node(self.group, node, self.nodes)

    def children_of(self, target: str) -> list[Child]:
        """The live processes of a process name or of a host (its services and its NATS node)."""
        if target.startswith("h") and target[1:].isdigit():
            names = {p.name for p in self.procs if p.host == target} | {f"nats-{target[1:]}"}
        else:
            names = {target}
        return [c for c in self.group.children if c.name in names and c.alive()]

    def restore(self, timeout_s: float = 90.0) -> list[str]:
        """Start again whatever is not running, as an operator's supervisor would: NATS
        nodes first, then services. A DEP instance comes back whole: a rank left alone (its
        peer died) leaves by itself within dp_timeout_s, or is stopped, before all its ranks
        start again. Returns what was started."""
        started = []
        for node in self.nodes:
            if self.group.live(node.name) is None:
                self.restart_nats(node.name)
                started.append(node.name)
        instances: dict[str, list[Proc]] = {}
        for p in self.procs:
            inst = _sets_of(p.argv).get("instance_id")
            if inst:
                instances.setdefault(inst, []).append(p)
            elif self.group.live(p.name) is None:
                self.start(p)
                started.append(p.name)
        for ranks in instances.values():
            if all(self.group.live(p.name) for p in ranks):
                continue
            deadline = time.monotonic() + self.cfg.dp_timeout_s + 10
            while any(self.group.live(p.name) for p in ranks) and time.monotonic() < deadline:
                time.sleep(0.2)
            for p in ranks:
                if (c := self.group.live(p.name)) is not None:
                    c.popen.kill()
                    c.popen.wait(10)
            for p in ranks:
                self.start(p)
                started.append(p.name)
        if started:
            self._wait_ready(timeout_s)
        return started

    def rss_mb(self) -> dict[str, tuple[int, float]]:
        """Every live process: (pid, resident MiB)."""
        out = {}
        for c in self.group.children:
            if c.alive():
                try:
                    text = Path(f"/proc/{c.popen.pid}/status").read_text()
                except OSError:
                    continue
                kb = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("VmRSS:")), 0)
                out[c.name] = (c.popen.pid, kb / 1024)
        return out

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
            return json.loads(r.read())

    def _wait_ready(self, timeout_s: float) -> None:
        want = sum(1 for p in self.procs if p.argv[0] == "moemesh.services.decode")
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            dead = self.group.dead()
            if dead:
                raise RuntimeError(f"{dead[0].name} exited during start-up:\n{dead[0].log_tail()}")
            try:
                h = self.health()
                if h.get("ready") and h["workers"].get("decode", 0) >= want and h["workers"].get("prefill", 0) >= 1:
                    return
                last = json.dumps(h.get("workers"))
            except OSError as e:
                last = str(e)
            time.sleep(0.25)
        raise TimeoutError(f"rack not ready after {timeout_s:.0f}s ({last}); logs in {self.log_dir}")


# ---- scenarios ------------------------------------------------------------------------------
def run(cfg: RackConfig) -> dict:
    root = Path(cfg.log_dir) if cfg.log_dir else default_home() / "runs" / time.strftime("rack-%Y%m%d-%H%M%S")
    model = cfg.model or str(ensure_tiny_model(default_home()))
    rows = []
    for name in cfg.scenarios:
        try:
            rows.append(run_scenario(cfg, SCENARIOS[name], root / name, model))
        except Exception as e:  # one scenario that could not run must not cost the others
            rows.append({"scenario": name, "failed": f"{type(e).__name__}: {e}", "goal": "FAILED"})
        print(f"rack: {name} done", file=sys.stderr)
    return {"bench": "rack", "config": asdict(cfg), "env": environment(), "goal": report.GOALS,
            "log_dir": str(root), "scenarios": rows}


def _balancer_for(scenarios) -> list[str] | None:
    """The rack's balancer, where a scenario cuts a move: it moves only when asked."""
    return rack_moves.balancer_sets(60.0, MOVE_TIMEOUT_S) if any(s.fault == "move" for s in scenarios) else None


def run_scenario(cfg: RackConfig, sc: RackScenario, log_dir: Path, model: str) -> dict:
    with Rack(cfg, log_dir, model, _balancer_for([sc])) as rack:
        load = ChaosLoad(urls=[rack.url], model=Path(model).name, streams=cfg.streams, max_tokens=cfg.max_tokens,
                         prompt_tokens=cfg.prompt_tokens, ready_tokens=cfg.ready_tokens, probe_rate=cfg.probe_rate,
                         probe_s=sc.probe_s, probe_turns=sc.probe_turns)
        with LoadClient(load, log_dir / "client.log") as client:
            client.wait("sent", timeout_s=300.0)  # probe_turns = 2 runs the first turns first
            client.wait("streaming")
            victims = rack.children_of(sc.target)
            if not victims:
                raise RuntimeError(f"nothing of {sc.target} is running")
            if sc.fault == "move":
                pulls_before = _prefill_pulls(rack)
                t_fault = strike(rack, sc, victims)
                client.fault(t_fault, t_fault + cfg.deadline_s)
            else:
                t_fault = time.time() + sc.lead_s
                client.fault(t_fault, t_fault + sc.duration_s + cfg.deadline_s)
                time.sleep(max(0.0, t_fault - time.time()))
                pulls_before = _prefill_pulls(rack)
                strike(rack, sc, victims)
            if sc.duration_s:
                time.sleep(max(0.0, t_fault + sc.duration_s - time.time()))
                heal(rack, sc, victims)
            result = client.result(t_fault + sc.duration_s + cfg.deadline_s + 60 - time.time())
        observed = {"victim": sc.target, "victim_role": ""}
        observed.update(_gateway_counters([rack.url]))
        observed["detected_s"] = _detected(rack, sc, t_fault)
        observed["leftover"] = _leftover(rack)
        observed["health"] = _safe(rack.health)
        pulls_after = _prefill_pulls(rack)
        if sc.fault == "move":
            move = rack_moves.judge(log_dir, list(MOVED_RANKS), sc.target == "balancer", MOVE_TIMEOUT_S + 10)
    row = report.scenario_row(sc.name, result, observed, references=_references(cfg, model) if cfg.real else None)
    row["leftover"] = observed["leftover"]
    if sc.fault == "move":
        row["move"] = move
    if sc.probe_turns == 2:
        row["second_turns"] = second_turns(result, pulls_before, pulls_after, cfg.transfer_timeout_s)
    row["goal"] = goal_check(row, sc)
    return row


def _prefill_pulls(rack: Rack) -> dict[str, float]:
    """The prefill workers' prefix-fetch counters, summed."""
    import asyncio

    names = [p.name for p in rack.procs if p.argv[0] == "moemesh.services.prefill"]
    stats = asyncio.run(_stats_of(rack.nats_url, names))
    keys = ("kv_pulled_tokens", "kv_pulls_failed", "kv_pull_wait_max_s")
    return {k: (max if k.endswith("_max_s") else sum)(s.counters.get(k, 0.0) for s in stats.values()) for k in keys}


def second_turns(result: dict, before: dict, after: dict, transfer_timeout_s: float) -> dict:
    """Pure: what the second-turn probes show of prefix fetches around the fault."""
    probes, at = result.get("probes", []), result.get("fault_at") or 0.0
    after_fault = [p for p in probes if p["t_sent"] >= at]
    ttfts = [p["ttft_s"] for p in after_fault if p.get("ttft_s") is not None]
    return {"sent_before_fault": len(probes) - len(after_fault), "sent_after_fault": len(after_fault),
            "complete": sum(1 for p in probes if p["error"] is None),
            "ttft_max_after_s": max(ttfts) if ttfts else None,
            "pulled_tokens_before_fault": before["kv_pulled_tokens"],
            "pulled_tokens_after_fault": after["kv_pulled_tokens"] - before["kv_pulled_tokens"],
            "fetches_given_up": after["kv_pulls_failed"] - before["kv_pulls_failed"],
            "fetch_wait_max_s": after["kv_pull_wait_max_s"],
            "fetch_wait_goal_s": transfer_timeout_s + PULL_SLACK_S}


def _references(cfg: RackConfig, model: str) -> dict[int, str]:
    """With the real model: each stream's text as the offline engine writes it (the
    digest the load client keeps), what the mesh must reproduce through every fault."""
    import hashlib

    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.llm import LLM
    from moemesh.shared.protocol.messages import SamplingParams
    from moemesh.tools.bench.chaos_client import prompt_ids

    llm = LLM(EngineConfig(model=model, num_kv_blocks=max(512, cfg.streams * 16)))
    params = SamplingParams(max_tokens=cfg.max_tokens, min_tokens=cfg.max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([prompt_ids(i, cfg.prompt_tokens) for i in range(cfg.streams)], params)
    return {i: hashlib.sha1(o.text.encode()).hexdigest() for i, o in enumerate(outs)}


def strike(rack: Rack, sc: RackScenario, victims: list[Child]) -> float:
    """Inject the fault; returns its unix time (a cut move's: when its victim was killed)."""
    if sc.fault == "move":
        import asyncio

        def kill() -> None:
            for c in victims:
                c.popen.send_signal(signal.SIGKILL)

        return asyncio.run(rack_moves.cut_move(rack.nats_url, MOVED_INSTANCE, len(MOVED_RANKS), kill))
    at = time.time()
    if sc.fault == "kill":
        for c in victims:
            c.popen.send_signal(signal.SIGKILL)
    elif sc.fault == "stop":
        for c in victims:
            c.popen.send_signal(signal.SIGSTOP)
    elif sc.fault == "cut":
        rack.net.set_plane(sc.target, "data", up=False)
    elif sc.fault == "dark":
        for plane in ("ctl", "data"):
            rack.net.set_plane(sc.target, plane, up=False)
        for c in victims:
            c.popen.send_signal(signal.SIGKILL)
    else:
        raise ValueError(sc.fault)
    return at


def heal(rack: Rack, sc: RackScenario, victims: list[Child]) -> None:
    if sc.fault == "stop":
        for c in victims:
            c.popen.send_signal(signal.SIGCONT)
    elif sc.fault == "cut":
        rack.net.set_plane(sc.target, "data", up=True)
    elif sc.fault == "dark":  # the host is back (replaced, rebooted): its links, not its processes
        for plane in ("ctl", "data"):
            rack.net.set_plane(sc.target, plane, up=True)


def _safe(f):
    try:
        return f()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _leftover(rack: Rack, within_s: float = LEFTOVER_WITHIN_S) -> dict:
    """What the live workers still hold once the load is over: requests, used KV blocks,
    staging bytes. Asked until all of it is back (a failed hand-off's staging waits out its
    lease), for at most within_s; `clean_after_s` says when it was, None if never."""
    import asyncio

    names = [p.name for p in rack.procs if p.argv[0] in ("moemesh.services.prefill", "moemesh.services.decode")]
    t0 = time.monotonic()
    while True:
        try:
            stats = asyncio.run(_stats_of(rack.nats_url, names))
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        held = {w: {"requests": sum(s.requests_by_gateway.values()),
                    "blocks_used": s.load.num_blocks - s.load.num_free_blocks,
                    "staging_bytes": s.staging_bytes_used} for w, s in stats.items()}
        clean = not any(any(v.values()) for v in held.values())
        if clean or time.monotonic() - t0 > within_s:
            return {"workers": held, "clean_after_s": time.monotonic() - t0 if clean else None}
        time.sleep(0.5)


def _detected(rack: Rack, sc: RackScenario, t_fault: float) -> float | None:
    p = rack.log_dir / "gateway.log"
    text = p.read_text(errors="replace") if p.exists() else ""
    names = [sc.target] if not sc.target.startswith("h") else [q.name for q in rack.procs if q.host == sc.target]
    seen = [t for n in names for needle in (f"worker {n} is suspect", f"worker {n} stopped sending heartbeats")
            for t in report.log_times(text, needle) if t >= t_fault - 1]
    return max(0.0, min(seen) - t_fault) if seen else None


def goal_check(row: dict, sc: RackScenario) -> str:
    missed = []
    if row["complete_of_counted"] < report.GOALS["complete_share_min"] * row["counted"]:
        missed.append("complete")
    if row["hung"]:
        missed.append("hung")
    if row["tokens_lost"] or row["wrong"]:
        missed.append("tokens")
    if row["max_stall_s"] > sc.stall_goal_s:
        missed.append(f"stall > {sc.stall_goal_s:g} s")
    if (row.get("leftover") or {}).get("clean_after_s") is None:
        missed.append("leftover")
    if sc.name == "straggler" and row["migrated"]:
        missed.append("migrated a slow rank's streams")
    if (m := row.get("move")) is not None:
        missed += rack_moves.move_goal(m)
    if (t := row.get("second_turns")) is not None:
        if t["complete"] < t["sent_before_fault"] + t["sent_after_fault"]:
            missed.append("second turns failed")
        if t["fetch_wait_max_s"] > t["fetch_wait_goal_s"]:
            missed.append(f"a fetch waited {t['fetch_wait_max_s']:.1f} s")
        if not t["pulled_tokens_before_fault"]:
            missed.append("no prefix was fetched before the fault")
    return f"MISSED ({', '.join(missed)})" if missed else "met"


def table(r: dict) -> str:
    c = r["config"]
    engine = "real tiny model" if c["real"] else f"mock step {c['mock_step_ms']:g} ms"
    lines = [f"rack of 3 hosts: {c['streams']} streams x {c['max_tokens']} tokens, {engine}; "
             f"deadline {c['deadline_s']:g} s",
             f"{'scenario':<13} {'complete':>9} {'migr':>5} {'error':>5} {'hung':>4} {'short':>5} {'wrong':>5} "
             f"{'stall s':>7} {'detect s':>8} {'probes ok':>9} {'clean s':>7}  goal"]
    for row in r["scenarios"]:
        if "failed" in row:
            lines.append(f"{row['scenario']:<13} FAILED: {row['failed']}")
            continue
        lines.append(
            f"{row['scenario']:<13} {row['complete_of_counted']:>4}/{row['counted']:<4} {report._n(row['migrated']):>5} "
            f"{row['error']:>5} {row['hung']:>4} {row['short']:>5} {row['wrong']:>5} {row['max_stall_s']:>7.2f} "
            f"{report._n(row['detected_s'], '.2f'):>8} {row['probes'] - row['probe_errors']:>4}/{row['probes']:<4} "
            f"{report._n((row.get('leftover') or {}).get('clean_after_s'), '.1f'):>7}  {row['goal']}")
        if (m := row.get("move")) is not None:
            lines.append(f"{'':<13} the move: switched on {', '.join(m['switched']) or 'no rank'}; "
                         f"dropped by {', '.join(m['dropped']) or 'no rank'}")
        if (t := row.get("second_turns")) is not None:
            lines.append(
                f"{'':<13} second turns: {t['complete']}/{t['sent_before_fault'] + t['sent_after_fault']} complete "
                f"({t['sent_after_fault']} sent after the fault), first token within "
                f"{report._n(t['ttft_max_after_s'], '.2f')} s; fetched {t['pulled_tokens_before_fault']:.0f} tokens "
                f"before, {t['pulled_tokens_after_fault']:.0f} after; {t['fetches_given_up']:.0f} fetches given up, "
                f"the longest wait {t['fetch_wait_max_s']:.2f} s (goal <= {t['fetch_wait_goal_s']:g})")
    lines.append("clean s: after the load, until every worker held no request, KV block or staging byte "
                 f"(-: not within {LEFTOVER_WITHIN_S:.0f} s); detect s: the gateway's first word of the victim")
    return "\n".join(lines)


# ---- soak ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1200.0
    every_s: float = 120.0  # a fault this often, rotating through the scenarios
    streams: int = 64
    settle_s: float = 20.0  # load before the first fault, and before the memory at start is taken


def run_soak(cfg: RackConfig, soak: SoakConfig) -> dict:
    """One rack under a steady load for soak.duration_s, a fault every soak.every_s (the
    scenarios in turn), each healed and what it killed started again before the next."""
    import subprocess

    from moemesh.tools.bench.soak_client import SoakLoad

    log_dir = Path(cfg.log_dir) if cfg.log_dir else default_home() / "runs" / time.strftime("soak-%Y%m%d-%H%M%S")
    model = cfg.model or str(ensure_tiny_model(default_home()))
    faults = []
    with Rack(cfg, log_dir, model, _balancer_for([SCENARIOS[n] for n in cfg.scenarios])) as rack:
        load = SoakLoad(url=rack.url, model=Path(model).name, streams=soak.streams, max_tokens=cfg.max_tokens,
                        prompt_tokens=cfg.prompt_tokens, duration_s=soak.duration_s)
        with open(log_dir / "soak-client.log", "ab") as err:
            client = subprocess.Popen([sys.executable, "-m", "moemesh.tools.bench.soak_client", json.dumps(asdict(load))],
                                      stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            t0 = time.time()
            time.sleep(soak.settle_s)
            mem_start = rack.rss_mb()
            samples = [(time.time() - t0, mem_start)]  # before each fault: a trend, or a plateau
            held_start = _leftover(rack, within_s=0)
            k = 0
            while time.time() + soak.every_s < t0 + soak.duration_s:
                time.sleep(max(0.0, t0 + soak.settle_s + k * soak.every_s - time.time()))
                if k:
                    samples.append((time.time() - t0, rack.rss_mb()))
                sc = SCENARIOS[cfg.scenarios[k % len(cfg.scenarios)]]
                victims = rack.children_of(sc.target)
                try:
                    at = strike(rack, sc, victims)
                except Exception as e:  # a move the ranks never staged: nothing was cut
                    faults.append({"scenario": sc.name, "at_s": time.time() - t0,
                                   "strike_failed": f"{type(e).__name__}: {e}"})
                    k += 1
                    continue
                if sc.duration_s:
                    time.sleep(sc.duration_s)
                    heal(rack, sc, victims)
                time.sleep(5.0)  # the mesh's own recovery first (migrations, reconnects)
                if sc.fault == "dark":
                    heal(rack, sc, victims)
                try:
                    started = rack.restore()
                    faults.append({"scenario": sc.name, "at_s": at - t0, "restarted": started,
                                   "back_after_s": time.time() - at})
                except Exception as e:
                    faults.append({"scenario": sc.name, "at_s": at - t0, "restore_failed": f"{type(e).__name__}: {e}"})
                print(f"soak: {sc.name} at {at - t0:.0f}s", file=sys.stderr)
                k += 1
            out, _ = client.communicate(timeout=soak.duration_s + 120)
        finally:
            if client.poll() is None:
                client.kill()
        result = json.loads(out.strip().splitlines()[-1])
        mem_end = rack.rss_mb()
        held_end = _leftover(rack)
    same = {n: (mem_start[n][1], mem_end[n][1]) for n in mem_start if n in mem_end and mem_start[n][0] == mem_end[n][0]}
    samples.append((time.time() - t0, mem_end))
    series = {n: [(round(t), round(m[n][1], 1)) for t, m in samples if n in m and m[n][0] == mem_start[n][0]]
              for n in same}
    row = {"requests": result["requests"], "outcomes": result["outcomes"], "errors": result["errors"],
           "max_stall_s": result["max_stall_s"], "lost_without_clear_error": result["lost_without_clear_error"],
           "faults": faults, "memory_mb": same, "memory_series_mb": series, "restarted": sorted(set(mem_end) - set(same)),
           "held_at_start": held_start, "held_at_end": held_end}
    lost = sum(result["outcomes"][k] for k in ("short", "wrong", "hung"))
    grown = {n: (b - a) / a for n, (a, b) in same.items() if a > 0 and (b - a) / a > 0.10}
    missed = ([f"{lost} lost without a clear error"] if lost else []) + \
             ([f"memory grew over 10%: {', '.join(sorted(grown))}"] if grown else []) + \
             (["held at the end"] if held_end.get("clean_after_s") is None else [])
    row["goal"] = f"MISSED ({'; '.join(missed)})" if missed else "met"
    return {"bench": "rack-soak", "config": asdict(cfg), "soak": asdict(soak), "env": environment(),
            "log_dir": str(log_dir), "soak_result": row}


def soak_table(r: dict) -> str:
    s, c = r["soak_result"], r["soak"]
    lines = [f"soak: {c['duration_s'] / 60:.0f} min at {c['streams']} streams, a fault every {c['every_s']:g} s",
             f"requests {s['requests']}: " + ", ".join(f"{k} {v}" for k, v in s["outcomes"].items())
             + f"; errors {s['errors'] or 'none'}; longest stall {s['max_stall_s']:.2f} s",
             "faults: " + ", ".join(f"{f['scenario']}@{f['at_s']:.0f}s"
                                    + (f" (back in {f['back_after_s']:.0f}s)" if "back_after_s" in f else " (NOT restored)")
                                    for f in s["faults"])]
    for name, (a, b) in sorted(s["memory_mb"].items()):
        lines.append(f"  {name:<14} RSS {a:7.1f} -> {b:7.1f} MiB ({(b - a) / a * 100:+.1f}%)")
        if a and (b - a) / a > 0.05:  # grown: a trend, or a plateau reached early?
            lines.append("  " + " " * 14 + " before each fault: "
                         + ", ".join(f"{m:.1f}@{t}s" for t, m in s.get("memory_series_mb", {}).get(name, [])))
    if s["restarted"]:
        lines.append(f"  restarted during the soak (not compared): {', '.join(s['restarted'])}")
    lines.append(f"held at the end: clean after {report._n(s['held_at_end'].get('clean_after_s'), '.1f')} s")
    lines.append(f"goal: {s['goal']}")
    return "\n".join(lines)
