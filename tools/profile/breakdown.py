"""Where a request's and a decode step's time went: pure functions over span records.

Per request, the phases partition the gateway root span (end-to-end):
    queue        queue.wait: job received by the prefill worker -> first scheduled
    prefill      prefill.batch: first scheduled -> first token
    kv_transfer  kv.transfer: the decode worker's KV pull
    decode       the decode span minus the transfer inside it (import wait + steps)
    streaming    decode span end -> root end: the last tokens' delivery to the client
    other        the rest: gateway admission, dispatch to prefill, the KVReady hand-off
TTFT (root start -> the stream span's first_token event) overlaps the phases, so it is
reported beside them, not in the partition. Times from different hosts assume synced clocks.

Per step, from the decode spans' "step" events (shared/service/runtime.py):
    forward, host (the host work the step waited for, the serving loop's gap between
    steps included), rank_wait. They partition the step. When the loop overlaps the host
    with the forward, most host work is hidden: host_work reports all of it, apart.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from moemesh.tools.bench.env import percentile
from moemesh.tools.profile.spans import RequestSpans, attr, duration_ns
from moemesh.shared.telemetry.chrome_trace import service_of

PHASES = ("queue", "prefill", "kv_transfer", "decode", "streaming", "other")
STEP_PHASES = ("forward", "host", "rank_wait")
STEP_TOLERANCE_NS = 50_000_000  # one step's events are added in one loop pass, well inside this


@dataclass(frozen=True)
class RequestPhases:
    trace_id: str
    request_id: str | None
    complete: bool
    reason: str  # why not complete; "" when complete
    decode_only: bool
    e2e_ms: float | None
    phases: dict[str, float | None]  # ms; None where the span is missing or does not apply
    ttft_ms: float | None = None
    decode_steps: int | None = None
    completion_tokens: int | None = None


@dataclass
class Step:
    worker: str
    time_ns: int
    num_seqs: int
    forward_ms: float
    host_ms: float
    rank_wait_ms: float
    num_events: int = 1  # requests in the trace file that saw this step
    tokens: int = 0  # summed over those requests' events
    host_work_ms: float | None = None  # all host work; host_ms is the part the step waited for

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.host_ms + self.rank_wait_ms


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e6


def incomplete_reason(req: RequestSpans) -> str:
    if req.root is None:
        return "no root span (in flight or lost)"
    code = attr(req.root, "http.status_code")
    if (req.root.get("status") or {}).get("code") == "ERROR" or (isinstance(code, int) and code >= 400):
        return f"http {code}" if code is not None else "error"
    if req.decode is None:
        return "no decode span"
    if any(e.get("name") == "aborted" for e in req.decode.get("events", [])):
        return "aborted"
    if (req.decode.get("status") or {}).get("code") == "ERROR":
        return "decode error"
    if attr(req.decode, "finish.reason") is None:
        return "decode unfinished"
    return ""


def request_phases(req: RequestSpans) -> RequestPhases:
    """The phase durations of one request; partial when spans are missing."""
    root, dec = req.root, req.decode
    kv = duration_ns(req.kv_transfer)
    ph: dict[str, float | None] = {
        "queue": _ms(duration_ns(req.queue)),
        "prefill": _ms(duration_ns(req.prefill_batch)),
        "kv_transfer": _ms(kv),
        "decode": None if dec is None else _ms(duration_ns(dec) - (kv or 0)),
        "streaming": None if root is None or dec is None else _ms(root["end_time_ns"] - dec["end_time_ns"]),
        "other": None,
    }
    e2e = _ms(duration_ns(root))
    if e2e is not None and dec is not None:
        ph["other"] = e2e - sum(v for k, v in ph.items() if k != "other" and v is not None)
    ttft = None
    if root is not None and req.stream is not None:
        first = [e["time_ns"] for e in req.stream.get("events", []) if e.get("name") == "first_token"]
        if first:
            ttft = _ms(min(first) - root["start_time_ns"])
    reason = incomplete_reason(req)
    steps, tokens = attr(dec, "decode.steps"), attr(req.stream, "completion.tokens")
    return RequestPhases(req.trace_id, req.request_id, not reason, reason, req.decode_only, e2e, ph, ttft,
                         steps if isinstance(steps, int) else None, tokens if isinstance(tokens, int) else None)


def stats(values: list[float]) -> dict:
    """n, p50, p90, p99 and mean; None figures for an empty list (JSON has no NaN)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None}
    return {"n": len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "mean": sum(values) / len(values)}


def summarize_requests(rows: list[RequestPhases]) -> dict:
    """Stats per phase over complete requests.

    `share` is the phase's total time over the total end-to-end time, and `mean_of_all`
    the total over the number of complete requests (a phase that does not apply counts 0),
    so both add up across phases even when decode-only and disaggregated requests mix.
    """
    done = [r for r in rows if r.complete]
    total_e2e = sum(r.e2e_ms for r in done)
    phases = {}
    for name in PHASES:
        vals = [r.phases[name] for r in done if r.phases[name] is not None]
        phases[name] = stats(vals) | {"share": sum(vals) / total_e2e if total_e2e > 0 else None,
                                      "mean_of_all": sum(vals) / len(done) if done else None}
    incomplete: dict[str, int] = defaultdict(int)
    for r in rows:
        if not r.complete:
            incomplete[r.reason] += 1
    return {"num_requests": len(rows), "num_complete": len(done), "num_decode_only": sum(r.decode_only for r in done),
            "incomplete": dict(incomplete), "phases": phases, "e2e_ms": stats([r.e2e_ms for r in done]),
            "ttft_ms": stats([r.ttft_ms for r in done if r.ttft_ms is not None])}


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def steps_from_spans(spans: list[dict], tolerance_ns: int = STEP_TOLERANCE_NS) -> tuple[list[Step], int]:
    """Distinct engine steps from the "step" events of all decode spans.

    Every request in a step gets its own event, with the step's own figures (the same
    floats) and times a few µs apart. Events are grouped by (worker, figures), then split
    where times are more than `tolerance_ns` apart: grouping on the figures, not on
    rounded times alone, cannot cut one step in two at a rounding boundary.

    Returns:
        (steps ordered by time, number of step events read)
    """
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    num_events = 0
    for s in spans:
        if s["name"] != "decode":
            continue
        worker = attr(s, "worker.id") or service_of(s)
        for e in s.get("events", []):
            a = e.get("attributes") or {}
            figs = tuple(_num(a.get(k)) for k in ("forward_ms", "host_ms", "rank_wait_ms"))
            if e.get("name") != "step" or None in figs:
                continue
            num_events += 1
            seqs = int(_num(a.get("batch.num_seqs")) or 0)
            exposed = _num(a.get("host_exposed_ms"))
            groups[(worker, seqs, *figs, exposed)].append((e["time_ns"], int(_num(a.get("tokens")) or 0)))
    steps = []
    for (worker, seqs, fwd, host, wait, exposed), evs in groups.items():
        evs.sort()
        cur = None
        for t, tokens in evs:
            if cur is None or t - cur.time_ns > tolerance_ns:
                waited = host if exposed is None else exposed
                cur = Step(worker, t, seqs, fwd, waited, wait, num_events=0, host_work_ms=host)
                steps.append(cur)
            cur.num_events += 1
            cur.tokens += tokens
    steps.sort(key=lambda st: (st.time_ns, st.worker))
    return steps, num_events


def summarize_steps(steps: list[Step], num_events: int = 0) -> dict:
    total = sum(st.total_ms for st in steps)
    phases = {}
    for name in STEP_PHASES:
        vals = [getattr(st, f"{name}_ms") for st in steps]
        phases[name] = stats(vals) | {"share": sum(vals) / total if total > 0 else None}
    work = [st.host_work_ms if st.host_work_ms is not None else st.host_ms for st in steps]
    return {"num_steps": len(steps), "num_events": num_events, "workers": sorted({st.worker for st in steps}),
            "phases": phases, "host_work_ms": stats(work), "step_ms": stats([st.total_ms for st in steps]),
            "batch_num_seqs": stats([float(st.num_seqs) for st in steps])}
