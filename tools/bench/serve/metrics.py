"""Serving metrics from per-request timestamps. Pure: no I/O, no clock.

Definitions (times in seconds on one monotonic clock, reported in ms):
- TTFT: first chunk with content - request sent.
- E2E: end of stream - request sent.
- TPOT: (E2E - TTFT) / (output_tokens - 1); undefined for a one-token answer.
- ITL: the gap between consecutive content chunks, split evenly over the tokens the later
  chunk carries (a chunk of k tokens after a gap g contributes k gaps of g/k). Tokens that
  ride in the first chunk add no ITL; they are covered by TTFT.
- tokens/s per user: output_tokens / E2E of each request, so queueing and prefill count
  against it (what the user waits for). decode tokens/s per user is 1 / TPOT.
- duration: first request sent -> last stream ended, over every measured request.
- by class (a priority mix): the same latencies for the requests of each priority, with
  how many of them were refused for capacity (429).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from moemesh.tools.bench.env import percentile


@dataclass
class RequestRecord:
    index: int
    session: int
    turn: int  # 1-based
    max_tokens: int
    target_input_tokens: int
    group: int | None = None
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # content chunks only
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    output_tokens: int = 0
    input_tokens: int | None = None  # as the server reported it (usage.prompt_tokens)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server says
    trace_input_tokens: int | None = None  # a replayed trace's prompt length before scaling
    token_source: str = "chunks"  # how chunk_tokens were counted: usage | spread | chunks (see client.py)
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None
    finish_reason: str | None = None
    worker: str | None = None
    priority: int | None = None  # the class it was sent in (a priority mix); None: no mix
    text: str = ""  # the answer; feeds the next agentic turn, not the report

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "text"}
        d["chunk_times"] = [round(t - self.start, 6) for t in self.chunk_times]  # offsets from start
        d["start"], d["end"] = round(self.start, 6), round(self.end, 6)
        d["ttft_ms"], d["tpot_ms"], d["e2e_ms"] = (_ms(ttft(self)), _ms(tpot(self)), _ms(e2e(self)))
        return d


def ttft(r: RequestRecord) -> float | None:
    return r.chunk_times[0] - r.start if r.chunk_times else None


def e2e(r: RequestRecord) -> float:
    return r.end - r.start


def tpot(r: RequestRecord) -> float | None:
    first = ttft(r)
    if first is None or r.output_tokens < 2:
        return None
    return (e2e(r) - first) / (r.output_tokens - 1)


def itl(r: RequestRecord) -> list[float]:
    gaps = []
    for prev, t, k in zip(r.chunk_times, r.chunk_times[1:], r.chunk_tokens[1:]):
        if k > 0:
            gaps.extend([(t - prev) / k] * k)
    return gaps


def tps_user(r: RequestRecord) -> float | None:
    d = e2e(r)
    return r.output_tokens / d if d > 0 and r.output_tokens else None


def dist(xs: list[float], qs: tuple[int, ...] = (50, 90, 99), scale: float = 1.0) -> dict:
    """Mean and percentiles of xs times scale; None for each when xs is empty."""
    out = {"mean": sum(xs) / len(xs) * scale if xs else None}
    for q in qs:
        out[f"p{q}"] = percentile(xs, q) * scale if xs else None
    out["count"] = len(xs)
    return out


def summarize(records: list[RequestRecord], slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """The summary of one benchmark point; see the module docstring for definitions."""
    ok = [r for r in records if r.ok]
    duration = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    rate = (lambda n: n / duration if duration > 0 else None)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens if r.input_tokens is not None else r.target_input_tokens for r in ok)
    ttfts = [x for x in map(ttft, ok) if x is not None]
    tpots = [x for x in map(tpot, ok) if x is not None]
    users = [x for x in map(tps_user, ok) if x is not None]
    s = {
        "num_requests": len(records), "num_ok": len(ok), "num_errors": len(records) - len(ok),
        "duration_s": duration, "requests_per_s": rate(len(ok)),
        "output_tokens_per_s": rate(out_tokens), "input_tokens_per_s": rate(in_tokens),
        "total_output_tokens": out_tokens, "total_input_tokens": in_tokens,
        "input_tokens_reported": any(r.input_tokens is not None for r in ok),
        "ttft_ms": dist(ttfts, scale=1e3), "tpot_ms": dist(tpots, scale=1e3),
        "itl_ms": dist([g for r in ok for g in itl(r)], scale=1e3),
        "e2e_ms": dist([e2e(r) for r in ok], scale=1e3),
        "tps_per_user": dist(users, qs=(10, 50, 90)),
        "decode_tps_per_user": dist([1 / x for x in tpots if x > 0], qs=(10, 50, 90)),
    }
    s["headline_p90_tps_per_user"] = s["tps_per_user"]["p90"]
    workers = Counter()
    for r in ok:
        if r.worker is not None:
            workers[r.worker] += r.output_tokens
    if workers:
        s["per_worker_output_tokens_per_s"] = {w: rate(n) for w, n in sorted(workers.items())}
    s["goodput"] = _goodput(records, ok, slo_ttft_ms, slo_tpot_ms, rate)
    s["errors"] = _errors(records)
    s.update(vllm_fields(s, ok))
    if any(r.cached_tokens is not None for r in ok):
        s["prefix_hit_rate"] = prefix_cache(ok)["hit_rate"]
    if any(r.priority is not None for r in records):
        s["by_priority"] = by_priority(records)
    if any(r.turn > 1 for r in records):
        s["ttft_ms_by_turn"] = {
            "1": dist([x for r in ok if r.turn == 1 and (x := ttft(r)) is not None], scale=1e3),
            "2+": dist([x for r in ok if r.turn > 1 and (x := ttft(r)) is not None], scale=1e3),
        }
    return s


def prefix_cache(ok: list[RequestRecord]) -> dict:
    """Cached prompt tokens (usage.prompt_tokens_details) over the prompt tokens of the
    requests whose server said how many were cached."""
    told = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.input_tokens if r.input_tokens is not None else r.target_input_tokens for r in told)
    cached = sum(r.cached_tokens for r in told)
    return {"requests_reporting_cached": len(told), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else None}


def by_band(ok: list[RequestRecord], band_of, order: list[str]) -> dict:
    """TTFT and ITL of the requests in each band (band_of(record) -> its name), in order;
    bands no request fell in are left out."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in ok:
        groups.setdefault(band_of(r), []).append(r)
    return {b: {"count": len(groups[b]), **_first_and_gaps(groups[b])}
            for b in [*order, *sorted(set(groups) - set(order))] if b in groups}


def _first_and_gaps(ok: list[RequestRecord]) -> dict:
    """TTFT and ITL distributions (ms) of requests that succeeded."""
    return {"ttft_ms": dist([x for r in ok if (x := ttft(r)) is not None], scale=1e3),
            "itl_ms": dist([g for r in ok for g in itl(r)], scale=1e3)}


def by_priority(records: list[RequestRecord]) -> dict:
    """Per class, best (lowest) first: requests, how many succeeded and were refused for
    capacity (429), and the TTFT, ITL and E2E of those that succeeded."""
    groups: dict[int, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(r.priority or 0, []).append(r)
    out = {}
    for p in sorted(groups):
        rs = groups[p]
        ok = [r for r in rs if r.ok]
        out[str(p)] = {"num_requests": len(rs), "num_ok": len(ok), "num_429": sum(r.status == 429 for r in rs),
                       "num_errors": len(rs) - len(ok), **_first_and_gaps(ok),
                       "e2e_ms": dist([e2e(r) for r in ok], scale=1e3)}
    return out


VLLM_PERCENTILES = (50, 90, 99)


def vllm_fields(s: dict, ok: list[RequestRecord]) -> dict:
    """The same figures under `vllm bench serve`'s JSON names, so its tooling reads ours.
    Its ITL is the gap between chunks (ours splits a chunk's gap over its tokens: the
    same when every chunk carries one token)."""
    out = {"duration": s["duration_s"], "completed": s["num_ok"], "failed": s["num_errors"],
           "total_input_tokens": s["total_input_tokens"], "total_output_tokens": s["total_output_tokens"],
           "request_throughput": s["requests_per_s"], "output_throughput": s["output_tokens_per_s"],
           "total_token_throughput": (s["total_input_tokens"] + s["total_output_tokens"]) / s["duration_s"]
           if s["duration_s"] > 0 else None,
           "request_goodput": (s["goodput"] or {}).get("requests_per_s")}
    series = {"ttft": [x for r in ok if (x := ttft(r)) is not None], "tpot": [x for r in ok if (x := tpot(r)) is not None],
              "itl": [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])],
              "e2el": [e2e(r) for r in ok]}
    for name, xs in series.items():
        ms = [x * 1e3 for x in xs]
        mean = sum(ms) / len(ms) if ms else None
        out[f"mean_{name}_ms"] = mean
        out[f"median_{name}_ms"] = percentile(ms, 50) if ms else None
        out[f"std_{name}_ms"] = (sum((x - mean) ** 2 for x in ms) / len(ms)) ** 0.5 if ms else None
        for q in VLLM_PERCENTILES:
            out[f"p{q}_{name}_ms"] = percentile(ms, q) if ms else None
    out["input_lens"] = [r.input_tokens if r.input_tokens is not None else r.target_input_tokens for r in ok]
    out["output_lens"] = [r.output_tokens for r in ok]
    out["ttfts"] = series["ttft"]
    out["itls"] = [[b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])] for r in ok]
    return out


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A one-token answer has no TPOT and so cannot miss a TPOT target."""
    if not r.ok:
        return False
    first, per = ttft(r), tpot(r)
    if slo_ttft_ms is not None and (first is None or first * 1e3 > slo_ttft_ms):
        return False
    return slo_tpot_ms is None or per is None or per * 1e3 <= slo_tpot_ms


def _goodput(records, ok, slo_ttft_ms, slo_tpot_ms, rate) -> dict | None:
    if slo_ttft_ms is None and slo_tpot_ms is None:
        return None
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok)
    return {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "num_good": good,
            "requests_per_s": rate(good), "share": good / len(records) if records else None}


def _errors(records: list[RequestRecord]) -> dict:
    by_status = Counter(_error_kind(r) for r in records if not r.ok)
    messages = Counter((r.error or "")[:200] for r in records if not r.ok)
    return {"count": sum(by_status.values()), "by_status": dict(sorted(by_status.items())),
            "messages": [{"message": m, "count": n} for m, n in messages.most_common(10)]}


def _error_kind(r: RequestRecord) -> str:
    if r.status is None:
        return "no_response"
    return "stream_error" if r.status == 200 else str(r.status)  # a 200 that failed mid-stream


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3
