"""What `moemesh bench chaos` makes of one scenario's run, without I/O: each stream's
outcome, the scenario's row, the goals, the table, and the few log lines it reads.

Glossary (one stream, as its client saw it):
- complete: HTTP 200, every token (max_tokens token events), a normal finish, `[DONE]`,
  and the same text as the other streams (at temperature 0 on the mock engine, whose
  tokens depend on the position only, every stream's answer is the same).
- short: it finished normally (`[DONE]` after a finish reason) but with fewer tokens
  than asked: silent token loss. Its missing tokens are the scenario's tokens lost.
- wrong: every token came, but its text differs from the others'.
- error: it ended with a clear error (an error event, a refused request, a broken
  connection). In kill-gateway the killed gateway's streams end so by nature.
- hung: still open at the deadline.
- stall: the longest silence between two events of one stream, after its first.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime

# The issue's goals, and the ones that follow from them (see docs/reliability.md).
GOALS = {"complete_share_min": 0.995, "stall_max_s": 5.0, "routed_after_s": 2.0, "orphans_after_s": 3.0}
KINDS = ("complete", "short", "wrong", "error", "hung")


def outcome(s: dict, max_tokens: int, reference: str | None) -> str:
    """One stream's kind (see the glossary); reference: the text digest most full streams share."""
    if s["hung"]:
        return "hung"
    if s["error"] is not None or s["status"] != 200 or not s["done"] or s["finish"] not in ("length", "stop"):
        return "error"
    if s["tokens"] < max_tokens:
        return "short"
    if reference is not None and s["text_sha1"] != reference:
        return "wrong"
    return "complete"


def reference_text(streams: list[dict], max_tokens: int) -> str | None:
    """The text digest most streams with every token share (None when none has all)."""
    full = Counter(s["text_sha1"] for s in streams if s["tokens"] >= max_tokens and s["done"])
    return full.most_common(1)[0][0] if full else None


def scenario_row(name: str, result: dict, observed: dict, lost_gateway: int | None = None,
                 references: dict[int, str] | None = None) -> dict:
    """The row of one scenario.

    Args:
        name: the scenario.
        result: the load client's result line (chaos_client.run).
        observed: what the runner saw on the mesh side: the victim and its role, migrations,
            gaps and resends (from the surviving gateways' metrics), detected_s, orphans_at_kill
            and orphans_after_3s (None where not observed).
        lost_gateway: the index of the gateway the scenario killed; its streams are
            reported apart (lost to their clients by nature).
        references: stream -> the digest its text must have (a real model answers each
            prompt its own way); None: the digest most full streams share (the mock's).
    """
    cfg = result["config"]
    max_tokens = cfg["max_tokens"]
    streams = result["streams"]
    common = reference_text(streams, max_tokens)

    def kind(s: dict) -> str:
        return outcome(s, max_tokens, common if references is None else references.get(s["i"]))

    kinds = Counter(kind(s) for s in streams)
    lost = [s for s in streams if s["gateway"] == lost_gateway]
    kept = [s for s in streams if s["gateway"] != lost_gateway]
    ended = [s for s in kept if not s["hung"]]
    stalls = [s["max_gap_s"] for s in kept]
    ttfts = [s["t_first"] - s["t_sent"] for s in kept if s["t_first"] is not None]
    probes = result.get("probes", [])
    victim = observed.get("victim")
    routed = None
    if observed.get("victim_role") == "decode" and result.get("fault_at"):
        # The gateway names each stream's decode worker in x-moemesh-worker.
        after = result["fault_at"] + GOALS["routed_after_s"]
        routed = sum(1 for p in probes if p["t_sent"] > after and p["worker"] == victim)
    row = {
        "scenario": name,
        "streams": len(streams),
        **{k: kinds[k] for k in KINDS},
        "counted": len(kept),  # the streams the goals count (all but a killed gateway's)
        "complete_of_counted": sum(1 for s in kept if kind(s) == "complete"),
        "lost_with_gateway": len(lost),
        "tokens_lost": sum(max_tokens - s["tokens"] for s in streams if kind(s) == "short"),
        "max_stall_s": max(stalls, default=0.0),
        "stalls_over_5s": sum(1 for x in stalls if x > GOALS["stall_max_s"]),
        "max_ttft_s": max(ttfts, default=None),
        "last_end_after_fault_s": (max(s["t_end"] for s in ended) - result["fault_at"])
        if ended and result.get("fault_at") else None,
        "probes": len(probes),
        "probe_errors": sum(1 for p in probes if p["error"] is not None),
        "probe_error_kinds": dict(Counter(p["error"] for p in probes if p["error"] is not None)),
        "victim": victim,
        "on_victim": sum(1 for s in streams if s["worker"] == victim) if routed is not None else None,
        "migrated": observed.get("migrations"),
        "token_gaps": observed.get("token_gaps"),
        "token_resends": observed.get("token_resends"),
        "detected_s": observed.get("detected_s"),
        "routed_to_dead_after_2s": routed,
        "orphans_at_kill": observed.get("orphans_at_kill"),
        "orphans_after_3s": observed.get("orphans_after_3s"),
    }
    row["goal"] = goal_check(row)
    return row


def goal_check(row: dict) -> str:
    """"met", "MISSED (...)" or "-" for a row, against the goals of its scenario."""
    name, missed = row["scenario"], []
    if name in ("kill-decode", "kill-prefill", "drain-timeout"):
        if row["complete_of_counted"] < GOALS["complete_share_min"] * row["counted"]:
            missed.append("complete")
        if row["max_stall_s"] > GOALS["stall_max_s"] or row["hung"]:
            missed.append("stall")
        if row["routed_to_dead_after_2s"]:
            missed.append("routed to dead")
    elif name.startswith("nats-"):
        if row["complete_of_counted"] < row["counted"] or row["tokens_lost"]:
            missed.append("every token")
    elif name == "kill-gateway":
        if row["orphans_after_3s"] is None or row["orphans_after_3s"] > 0:
            missed.append("orphans")
        if row["complete_of_counted"] < row["counted"]:
            missed.append("survivors")
    else:
        return "-"
    return f"MISSED ({', '.join(missed)})" if missed else "met"


# ---- logs -------------------------------------------------------------------------------
# Every service logs "%(asctime)s %(levelname)s %(name)s: %(message)s" (shared/service/lifecycle.py).
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_times(text: str, needle: str) -> list[float]:
    """Unix times of the log lines that contain needle (the services log local time)."""
    out = []
    for line in text.splitlines():
        if needle in line:
            m = _STAMP.match(line)
            if m:
                out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def metric(text: str, name: str) -> float | None:
    """The sum of a metric's samples on a Prometheus text page, whatever their labels
    (the services label every sample with model_name); None when it has none."""
    found = [float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{"))]
    return sum(found) if found else None


# ---- the table ----------------------------------------------------------------------------
def table(rows: list[dict], c: dict) -> str:
    head = (f"{c['streams']} streams x {c['max_tokens']} tokens, mock step {c['mock_step_ms']:g} ms; "
            f"deadline {c['deadline_s']:g} s after the fault")
    cols = (f"{'scenario':<14} {'complete':>9} {'migr':>5} {'error':>5} {'hung':>4} {'short':>5} {'wrong':>5} "
            f"{'tok lost':>8} {'stall s':>7} {'ttft s':>6} {'detect s':>8} {'to dead':>7} {'orphans':>7} "
            f"{'probes ok':>9}  goal")
    lines = [head, cols]
    for r in rows:
        if "failed" in r:
            lines.append(f"{r['scenario']:<14} FAILED: {r['failed']}")
            continue
        complete = f"{r['complete_of_counted']}/{r['counted']}"
        orphans = "-" if r["orphans_after_3s"] is None else f"{r['orphans_after_3s']}/{r['orphans_at_kill']}"
        lines.append(
            f"{r['scenario']:<14} {complete:>9} {_n(r['migrated']):>5} {r['error']:>5} {r['hung']:>4} "
            f"{r['short']:>5} {r['wrong']:>5} {r['tokens_lost']:>8} {r['max_stall_s']:>7.2f} "
            f"{_n(r['max_ttft_s'], '.2f'):>6} {_n(r['detected_s'], '.2f'):>8} {_n(r['routed_to_dead_after_2s']):>7} "
            f"{orphans:>7} {r['probes'] - r['probe_errors']:>4}/{r['probes']:<4}  {r['goal']}")
    lines.append("complete: of the streams counted (a killed gateway's are not); orphans: left 3 s after the "
                 "kill / held by the workers at the kill; to dead: new requests routed to the dead decode worker 2 s or more "
                 "after it died")
    return "\n".join(lines)


def _n(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)
