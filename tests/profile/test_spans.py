from moemesh.tools.profile.breakdown import request_phases
from moemesh.tools.profile.spans import index_requests, load, started_between
from tests.profile.traces import Trace, full_request, ns


def test_one_request_per_trace_with_every_span_found():
    tr = Trace()
    a = full_request(tr, "a", 0.0)
    full_request(tr, "b", 10.0)
    reqs = index_requests(list(reversed(tr.records)))  # file order must not matter
    assert [r.trace_id[-1] for r in reqs] == ["a", "b"]
    r = reqs[0]
    for name, got in (("root", r.root), ("prefill", r.prefill), ("queue.wait", r.queue),
                      ("prefill.batch", r.prefill_batch), ("decode", r.decode), ("kv.transfer", r.kv_transfer),
                      ("kv.send", r.kv_send), ("stream", r.stream)):
        assert got is a[name], name


def test_two_requests_in_one_trace_are_split_by_root():
    tr = Trace()
    a = full_request(tr, "same", 0.0)
    b = full_request(tr, "same", 200.0)
    reqs = index_requests(tr.records)
    assert len(reqs) == 2
    assert reqs[0].root is a["root"] and reqs[0].decode is a["decode"] and reqs[0].queue is a["queue.wait"]
    assert reqs[1].root is b["root"] and reqs[1].decode is b["decode"] and reqs[1].stream is b["stream"]


def test_orphans_form_one_rootless_request():
    tr = Trace()
    a = full_request(tr, "a", 0.0)
    tr.records.remove(a["root"])
    [r] = index_requests(tr.records)
    assert r.root is None and r.decode is a["decode"] and r.prefill is a["prefill"] and r.queue is a["queue.wait"]


def test_retried_decode_prefers_the_finished_span():
    tr = Trace()
    a = full_request(tr, "a", 0.0)
    failed = tr.span("decode", "a", 19.0, 200.0, a["prefill"], "moemesh-decode", {"request.id": "r-a"},
                     status="ERROR")
    [r] = index_requests(tr.records)
    assert r.decode is a["decode"] and r.decode is not failed and r.kv_transfer is a["kv.transfer"]


def test_a_parent_cycle_does_not_hang():
    tr = Trace()
    x = tr.span("decode", "c", 0.0, 1.0)
    y = tr.span("kv.transfer", "c", 0.0, 1.0, x)
    x["parent_span_id"] = y["span_id"]
    [r] = index_requests(tr.records)
    assert r.root is None and r.decode is x


def test_window_keeps_spans_that_started_in_it():
    tr = Trace()
    full_request(tr, "a", 0.0)
    kept = started_between(tr.records, ns(2.0), ns(18.0))
    assert {s["name"] for s in kept} == {"prefill", "queue.wait", "prefill.batch"}


def test_load_keeps_inverted_spans_at_zero_length_and_skips_junk(tmp_path):
    tr = Trace()
    a = full_request(tr, "a", 0.0)
    q = a["queue.wait"]
    q["end_time_ns"] = q["start_time_ns"] - 2_000_000  # the racy end the prefill worker can write
    path = tr.write(tmp_path / "t.jsonl")
    with path.open("a") as f:
        f.write('{"name": "x"}\n\n[1, 2]\n{"trunc')
    spans, num_malformed, num_inverted = load(path)
    assert (len(spans), num_malformed, num_inverted) == (len(tr.records), 3, 1)
    [r] = [request_phases(x) for x in index_requests(spans)]
    assert r.phases["queue"] == 0.0 and r.complete
