"""`moemesh trace export` as a user runs it: spans recorded by two services, then a Chrome trace."""

import json

from moemesh.shared.telemetry.tracing import extract_context, get_tracer, inject_headers, setup_tracing, shutdown
from tests.cli_in_process import moemesh


def _record(path, num_requests):
    gw, dec = setup_tracing("gateway", jsonl_path=path), setup_tracing("decode", jsonl_path=path)
    trace_ids = []
    for _ in range(num_requests):
        with get_tracer(gw, "gw").start_as_current_span("http.request") as span:
            headers = inject_headers()
            trace_ids.append(f"{span.get_span_context().trace_id:032x}")
        with get_tracer(dec, "dec").start_as_current_span("decode", context=extract_context(headers)) as d:
            d.add_event("step")
    shutdown(gw)
    shutdown(dec)
    return trace_ids


def test_export_writes_a_chrome_trace_and_reports_bad_lines(tmp_path):
    src = tmp_path / "spans.jsonl"
    _record(src, 2)
    with open(src, "a") as f:
        f.write('{"truncated\nnot json\n')
    r = moemesh("trace", "export", str(src))
    assert r.returncode == 0, r.stderr
    assert "skipped 2 malformed" in r.stderr and "wrote 4 spans (2 traces, 2 services)" in r.stderr
    doc = json.loads((tmp_path / "spans.trace.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    procs = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert len(xs) == 4 and procs == {"gateway", "decode"}
    assert len([e for e in doc["traceEvents"] if e["ph"] == "i"]) == 2


def test_export_one_trace_to_a_chosen_file(tmp_path):
    src = tmp_path / "spans.jsonl"
    trace_ids = _record(src, 3)
    out = tmp_path / "out" / "one.json"
    r = moemesh("trace", "export", str(src), "-o", str(out), "--trace-id", trace_ids[1].upper())
    assert r.returncode == 0, r.stderr
    assert "malformed" not in r.stderr
    xs = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in xs) == ["decode", "http.request"]
    assert {e["args"]["trace_id"] for e in xs} == {trace_ids[1]}


def test_export_errors_are_one_line(tmp_path):
    r = moemesh("trace", "export", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    src = tmp_path / "spans.jsonl"
    _record(src, 1)
    r = moemesh("trace", "export", str(src), "--trace-id", "0" * 32)
    assert r.returncode == 2 and "no spans with trace id" in r.stderr and "Traceback" not in r.stderr
