"""The fault scenarios of `moemesh bench rack` (tools/bench/rack.py runs them), as data:
the command's parser lists them without importing the bench."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RackScenario:
    name: str
    # kill | stop (SIGSTOP, then SIGCONT) | cut (a host's data plane down, then up) |
    # dark (a host dies as hardware does: both its links go silent, then its processes die,
    # so no peer hears a reset or a closed connection; it never comes back)
    # move (a live expert move on decode-i0, `target` killed once every rank has staged it;
    # see tools/bench/rack_moves.py)
    fault: str
    target: str  # a process name, or a host (h1..h3: every process it runs)
    duration_s: float = 0.0  # stop, cut: how long
    stall_goal_s: float = 10.0
    probe_turns: int = 1  # 2: the probes are second turns, whose prefill fetches its prefix
    probe_s: float = 5.0  # probes go out for this long from `lead_s` before the fault
    lead_s: float = 0.0
    # straggler: a rank that is only slow keeps its streams (the mesh tells slow from dead:
    # a dead process has nothing subscribed on NATS any more; see services/gateway/mesh/migration.py)


SCENARIOS = {s.name: s for s in (
    RackScenario("kill-rank", "kill", "decode-i0-r1"),
    RackScenario("straggler", "stop", "decode-i0-r1", duration_s=3.0),
    RackScenario("cut-data", "cut", "h3", duration_s=10.0, stall_goal_s=5.0),
    RackScenario("nats-node", "kill", "nats-2", stall_goal_s=5.0),
    RackScenario("kill-host", "kill", "h3"),
    # The KV store's host (with decode-1) dies while second turns fetch their prefixes from
    # it: each fetch gives up within transfer_timeout_s and the prefix is computed again.
    RackScenario("store-host", "dark", "h3", probe_turns=2, probe_s=8.0, lead_s=2.0),
    RackScenario("move-cut", "move", "balancer"),
    RackScenario("move-cut-rank", "move", "decode-i0-r1"),
)}
