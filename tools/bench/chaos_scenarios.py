"""The fault scenarios of `moemesh bench chaos` (tools/bench/chaos.py runs them), as data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # kill (SIGKILL) | term (SIGTERM: a drain) | nats (the server down, then back)
    target: str = ""  # the role struck: prefill | decode | gateway
    outage_s: float = 0.0  # nats: how long the server stays down
    gateways: int = 1
    prefill_step_ms: float = 0.0  # a slower prefill, so that its workers have a queue to strand
    drain_timeout_s: float = 0.0  # decode workers' drain window (0: their default)


SCENARIOS = {s.name: s for s in (
    Scenario("kill-decode", "kill", "decode"),
    Scenario("kill-prefill", "kill", "prefill", prefill_step_ms=100.0),
    Scenario("kill-gateway", "kill", "gateway", gateways=2),
    Scenario("nats-2s", "nats", outage_s=2.0),
    Scenario("nats-5s", "nats", outage_s=5.0),
    Scenario("nats-10s", "nats", outage_s=10.0),
    Scenario("drain-timeout", "term", "decode", drain_timeout_s=1.0),
)}
