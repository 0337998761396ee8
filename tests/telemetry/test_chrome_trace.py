"""Span records to Chrome trace events: timing, rows, lanes, flows, and reading a damaged file."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.shared.telemetry.chrome_trace import load_jsonl, to_chrome_trace

T = "ab" * 16


def _span(name, sid, start, end, service, parent=None, trace_id=T, **kw):
    return {"name": name, "trace_id": trace_id, "span_id": sid, "parent_span_id": parent,
            "start_time_ns": start, "end_time_ns": end, "resource": {"service.name": service}, **kw}


def _by_ph(doc, ph):
    return [e for e in doc["traceEvents"] if e["ph"] == ph]


def _request():
    return [
        _span("decode", "d" * 16, 2_000_500, 4_000_000, "decode", parent="a" * 16, kind="SERVER",
              attributes={"num_tokens": 3},
              events=[{"name": "step", "time_ns": 3_000_000, "attributes": {"step": 1}}]),
        _span("http.request", "a" * 16, 1_000_000, 5_000_000, "gateway", attributes={"http.route": "/v1/x"}),
        _span("queue.wait", "b" * 16, 1_000_000, 1_500_000, "gateway", parent="a" * 16),
    ]


def test_complete_events_in_microseconds_with_ids_in_args():
    doc = to_chrome_trace(_request())
    x = {e["name"]: e for e in _by_ph(doc, "X")}
    # µs from the earliest start (1 ms), which the document records.
    assert doc["otherData"]["base_time_unix_ns"] == 1_000_000
    assert (x["http.request"]["ts"], x["http.request"]["dur"]) == (0.0, 4000.0)
    assert (x["decode"]["ts"], x["decode"]["dur"]) == (1000.5, 1999.5)
    assert x["decode"]["args"] == {"num_tokens": 3, "trace_id": T, "span_id": "d" * 16, "parent_span_id": "a" * 16}
    assert x["http.request"]["args"]["parent_span_id"] is None and x["decode"]["cat"] == "server"
    (step,) = _by_ph(doc, "i")
    assert (step["name"], step["ts"], step["s"]) == ("step", 2000.0, "t")
    assert step["args"]["step"] == 1 and step["args"]["span_id"] == "d" * 16
    assert (step["pid"], step["tid"]) == (x["decode"]["pid"], x["decode"]["tid"])
    json.dumps(doc)


def test_nanoseconds_survive_at_real_unix_times():
    t0 = 1_795_961_403_261_475_927
    doc = to_chrome_trace([_span("parent", "a" * 16, t0, t0 + 1001, "gateway"),
                           _span("child", "b" * 16, t0 + 1, t0 + 1000, "gateway", parent="a" * 16)])
    x = {e["name"]: e for e in _by_ph(doc, "X")}
    assert (x["parent"]["ts"], x["parent"]["dur"]) == (0.0, 1.001)
    assert (x["child"]["ts"], x["child"]["dur"]) == (0.001, 0.999)
    assert doc["otherData"]["base_time_unix_ns"] == t0


def test_empty_input():
    assert to_chrome_trace([])["traceEvents"] == []


def test_one_process_per_service_and_sorted_events():
    doc = to_chrome_trace(_request())
    names = {e["pid"]: e["args"]["name"] for e in _by_ph(doc, "M") if e["name"] == "process_name"}
    assert sorted(names.values()) == ["decode", "gateway"] and len(names) == 2
    x = {e["name"]: e for e in _by_ph(doc, "X")}
    assert names[x["http.request"]["pid"]] == names[x["queue.wait"]["pid"]] == "gateway"
    assert names[x["decode"]["pid"]] == "decode"
    events = doc["traceEvents"]
    assert all(e["ph"] == "M" for e in events[:len(names)])
    body = events[len(names):]
    assert [e["ts"] for e in body] == sorted(e["ts"] for e in body)
    # Parent before its child when both start together, or viewers nest them the wrong way round.
    assert [e["name"] for e in body[:2]] == ["http.request", "queue.wait"]


def test_cross_service_parent_gets_a_flow_arrow():
    doc = to_chrome_trace(_request())
    x = {e["name"]: e for e in _by_ph(doc, "X")}
    (s,), (f,) = _by_ph(doc, "s"), _by_ph(doc, "f")
    assert s["id"] == f["id"]
    assert (s["pid"], s["tid"], s["ts"]) == (x["http.request"]["pid"], x["http.request"]["tid"], 1000.5)
    assert (f["pid"], f["tid"], f["ts"], f["bp"]) == (x["decode"]["pid"], x["decode"]["tid"], 1000.5, "e")


def test_error_status_is_shown():
    doc = to_chrome_trace([_span("decode", "d" * 16, 0, 10, "decode",
                                 status={"code": "ERROR", "description": "kv pull failed"})])
    (x,) = _by_ph(doc, "X")
    assert x["args"]["status"] == "ERROR" and x["args"]["status_description"] == "kv pull failed"
    assert x["cname"] == "terrible"


def test_overlapping_requests_get_separate_lanes_and_children_follow_parents():
    spans = [_span("r1", "1" * 16, 0, 100, "decode"), _span("r2", "2" * 16, 50, 150, "decode"),
             _span("r2.step", "3" * 16, 60, 70, "decode", parent="2" * 16)]
    x = {e["name"]: e for e in _by_ph(to_chrome_trace(spans), "X")}
    assert x["r1"]["tid"] != x["r2"]["tid"]
    # r2.step also fits under r1's lane; it must go under its own parent.
    assert x["r2.step"]["tid"] == x["r2"]["tid"]


_interval = st.tuples(st.integers(0, 1000), st.integers(0, 300), st.sampled_from(["a", "b"]))


@settings(max_examples=200, deadline=None)
@given(st.lists(_interval, max_size=40))
def test_every_lane_holds_properly_nested_slices(intervals):
    spans = [_span(f"s{i}", f"{i:016x}", start, start + length, svc)
             for i, (start, length, svc) in enumerate(intervals)]
    xs = _by_ph(to_chrome_trace(spans), "X")
    assert len(xs) == len(spans)
    lanes = {}
    for e in xs:
        lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs in lanes.values():
        # Back to integer ns, as viewers do: float µs sums are not exact (0.001 + 0.14 > 0.141).
        slices = [(round(e["ts"] * 1000), round(e["dur"] * 1000)) for e in evs]
        open_ends = []
        for start, dur in sorted(slices, key=lambda sd: (sd[0], -sd[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or start + dur <= open_ends[-1], "slices overlap without nesting"
            open_ends.append(start + dur)


def test_load_jsonl_skips_and_counts_malformed_lines(tmp_path):
    good = _request()
    bad = ['{"name": "cut off', "[1, 2]", json.dumps({"name": "x"}),
           json.dumps({**good[0], "start_time_ns": "soon"}), json.dumps({**good[0], "end_time_ns": 1}),
           json.dumps({**good[0], "events": [{"name": "e"}]}), json.dumps({**good[0], "attributes": [1]}),
           json.dumps({**good[0], "start_time_ns": True})]
    path = tmp_path / "spans.jsonl"
    text = "\n".join([json.dumps(good[0]), *bad, "", json.dumps(good[1])]) + "\n"
    path.write_bytes(text.encode() + b"\xff\xfe{\n")
    spans, num_malformed = load_jsonl(path)
    assert [s["name"] for s in spans] == ["decode", "http.request"]
    assert num_malformed == len(bad) + 1  # the undecodable last line too
    to_chrome_trace(spans)
