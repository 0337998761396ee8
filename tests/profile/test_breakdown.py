import pytest

from moemesh.tools.profile.breakdown import (PHASES, request_phases, steps_from_spans, summarize_requests,
                                      summarize_steps)
from moemesh.tools.profile.spans import index_requests
from tests.profile.traces import Trace, full_request, ns, step


def _rows(tr: Trace):
    return [request_phases(r) for r in index_requests(tr.records)]


def test_phases_of_one_request_are_exact():
    tr = Trace()
    full_request(tr, "a", 0.0, queue=5, prefill=10, kv=4, decode=72, stream=5)
    [r] = _rows(tr)
    assert r.complete and r.reason == "" and not r.decode_only
    assert r.request_id == "r-a"
    assert r.phases == {"queue": 5.0, "prefill": 10.0, "kv_transfer": 4.0, "decode": 72.0, "streaming": 5.0,
                        "other": 4.0}
    assert r.e2e_ms == 100.0
    assert sum(r.phases.values()) == r.e2e_ms
    assert r.ttft_ms == 18.5
    assert r.completion_tokens == 3


def test_summary_over_requests_and_shares():
    tr = Trace()
    full_request(tr, "a", 0.0, queue=5, decode=10)
    full_request(tr, "b", 1000.0, queue=10, decode=20)
    full_request(tr, "c", 2000.0, queue=30, decode=30)
    s = summarize_requests(_rows(tr))
    assert s["num_requests"] == s["num_complete"] == 3 and s["incomplete"] == {}
    q = s["phases"]["queue"]
    assert q["n"] == 3 and q["p50"] == 10.0 and q["mean"] == 15.0
    assert q["p90"] == pytest.approx(26.0) and q["p99"] == pytest.approx(29.6)
    # e2e = 3 + queue + 10 + 1 + 4 + decode + 5 -> 38, 53, 83
    assert s["e2e_ms"]["mean"] == pytest.approx(58.0)
    assert q["share"] == pytest.approx(45 / 174)
    assert sum(s["phases"][k]["share"] for k in PHASES) == pytest.approx(1.0)
    assert sum(s["phases"][k]["mean_of_all"] for k in PHASES) == pytest.approx(58.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(3 + 10 + 10 + 0.5)


def test_request_aborted_before_decode_is_incomplete_but_keeps_its_prefill():
    tr = Trace()
    full_request(tr, "a", 0.0)
    full_request(tr, "b", 500.0, skip=("decode", "kv.transfer"))
    rows = _rows(tr)
    assert [r.complete for r in rows] == [True, False]
    b = rows[1]
    assert b.reason == "no decode span"
    assert b.phases["queue"] == 5.0 and b.phases["prefill"] == 10.0
    assert b.phases["decode"] is None and b.phases["streaming"] is None and b.phases["other"] is None
    s = summarize_requests(rows)
    assert s["num_complete"] == 1 and s["incomplete"] == {"no decode span": 1}
    assert s["phases"]["queue"]["n"] == 1


def test_missing_root_and_missing_children_do_not_crash():
    tr = Trace()
    sp = full_request(tr, "a", 0.0, skip=("queue.wait", "kv.transfer", "stream"))
    tr.records.remove(sp["root"])  # still in flight: the gateway's span is written last
    full_request(tr, "b", 500.0, skip=("queue.wait", "kv.transfer", "stream"))
    rows = _rows(tr)
    a, b = rows
    assert not a.complete and a.reason.startswith("no root") and a.e2e_ms is None
    assert a.phases["decode"] == 72.0 + 4.0  # no transfer span to take out
    assert b.complete and b.phases["queue"] is None and b.phases["kv_transfer"] is None and b.ttft_ms is None
    # what is missing falls into "other", so the phases still add up to the end-to-end time
    assert sum(v for v in b.phases.values() if v is not None) == b.e2e_ms


def test_aborted_and_failed_requests():
    tr = Trace()
    sp = full_request(tr, "a", 0.0)
    del sp["decode"]["attributes"]["finish.reason"]
    sp["decode"]["events"].append({"name": "aborted", "time_ns": ns(50), "attributes": {"reason": "client"}})
    sp = full_request(tr, "b", 500.0)
    sp["root"]["attributes"]["http.status_code"] = 500
    reasons = [r.reason for r in _rows(tr)]
    assert reasons == ["aborted", "http 500"]
    assert summarize_requests(_rows(tr))["num_complete"] == 0


def test_decode_only_request():
    tr = Trace()
    sp = full_request(tr, "a", 0.0, skip=("prefill", "kv.transfer"))
    sp["decode"]["attributes"]["bench.dummy_kv"] = True
    [r] = _rows(tr)
    assert r.complete and r.decode_only
    assert r.phases["queue"] is None and r.phases["kv_transfer"] is None
    assert r.phases["decode"] == 76.0 and r.phases["streaming"] == 5.0 and r.phases["other"] == 19.0
    s = summarize_requests([r])
    assert s["num_decode_only"] == 1 and s["phases"]["queue"]["n"] == 0 and s["phases"]["queue"]["share"] == 0


def test_steps_shared_by_requests_are_counted_once():
    tr = Trace()
    # two requests in one batch on worker A see the same two steps, a few µs apart
    s1a, s1b = step(20.0, 2, 3.0, 1.0), step(20.004, 2, 3.0, 1.0)
    s2a, s2b = step(24.0, 2, 3.5, 0.5, 0.25), step(24.003, 2, 3.5, 0.5, 0.25)
    full_request(tr, "a", 0.0, steps=[s1a, s2a])
    full_request(tr, "b", 0.5, steps=[s1b, s2b])
    # another worker with the very same figures at the same time is a different step
    full_request(tr, "c", 0.0, steps=[step(20.0, 2, 3.0, 1.0)], worker="decode-b")
    # same worker and figures but a second later: a different step too
    full_request(tr, "d", 1000.0, steps=[step(1020.0, 2, 3.0, 1.0)])
    steps, num_events = steps_from_spans(tr.records)
    assert num_events == 6
    assert [(s.worker, s.num_events) for s in steps] == [("decode-a", 2), ("decode-b", 1), ("decode-a", 2),
                                                        ("decode-a", 1)]
    assert steps[2].time_ns == ns(24.0) and steps[2].rank_wait_ms == 0.25 and steps[2].tokens == 2
    s = summarize_steps(steps, num_events)
    assert s["num_steps"] == 4 and s["workers"] == ["decode-a", "decode-b"]
    assert s["phases"]["forward"]["mean"] == pytest.approx(3.125)
    assert s["phases"]["host"]["p50"] == pytest.approx(1.0)
    total = 4 + 4 + 4.25 + 4
    assert s["phases"]["forward"]["share"] == pytest.approx(12.5 / total)
    assert s["phases"]["rank_wait"]["share"] == pytest.approx(0.25 / total)
    assert s["step_ms"]["mean"] == pytest.approx(total / 4)


def test_malformed_step_events_are_ignored():
    tr = Trace()
    bad = ("step", 20.0, {"tokens": 1, "forward_ms": "x", "host_ms": 1.0, "rank_wait_ms": 0.0})
    other = ("kv_pull_failed", 21.0, {"error": "boom"})
    full_request(tr, "a", 0.0, steps=[bad, other, step(22.0, 1, 2.0, 1.0)])
    steps, num_events = steps_from_spans(tr.records)
    assert num_events == 1 and len(steps) == 1


def test_empty_input():
    s = summarize_requests([])
    assert s["num_complete"] == 0 and s["phases"]["decode"]["p50"] is None and s["phases"]["decode"]["share"] is None
    st = summarize_steps([])
    assert st["num_steps"] == 0 and st["phases"]["forward"]["mean"] is None
