"""setup_tracing and the JSON-lines exporter: what lands in the file, and which exporters are wired."""

import json
import re
import threading

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult

from moemesh.shared.telemetry.jsonl_exporter import JsonLinesSpanExporter
from moemesh.shared.telemetry.tracing import get_tracer, setup_tracing, shutdown


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _exporters(provider):
    # The SDK has no public accessor for a provider's processors.
    return [(type(p), p.span_exporter) for p in provider._active_span_processor._span_processors]


def test_nested_span_tree_is_written_with_parent_links(tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = setup_tracing("prefill", jsonl_path=path)
    tracer = get_tracer(provider, "test")
    with tracer.start_as_current_span("request"):
        with tracer.start_as_current_span("queue.wait"):
            pass
        with tracer.start_as_current_span("prefill.batch") as batch:
            batch.set_attribute("batch.num_tokens", 7)
            batch.set_attribute("request.ids", ["a", "b"])
            batch.add_event("chunk", {"chunk.index": 1})
            with tracer.start_as_current_span("kv.transfer"):
                pass
    provider.force_flush()  # batched off the request's path; what the batch timer does
    recs = _read(path)  # the running service's file holds them
    shutdown(provider)

    assert [r["name"] for r in recs] == ["queue.wait", "kv.transfer", "prefill.batch", "request"]
    by = {r["name"]: r for r in recs}
    root = by["request"]
    assert root["parent_span_id"] is None
    assert by["queue.wait"]["parent_span_id"] == root["span_id"]
    assert by["prefill.batch"]["parent_span_id"] == root["span_id"]
    assert by["kv.transfer"]["parent_span_id"] == by["prefill.batch"]["span_id"]
    assert len({r["span_id"] for r in recs}) == 4 and len({r["trace_id"] for r in recs}) == 1
    assert re.fullmatch(r"[0-9a-f]{32}", root["trace_id"]) and re.fullmatch(r"[0-9a-f]{16}", root["span_id"])
    for r in recs:
        assert r["resource"] == {"service.name": "prefill"}
        assert root["start_time_ns"] <= r["start_time_ns"] <= r["end_time_ns"] <= root["end_time_ns"]
    b = by["prefill.batch"]
    assert b["attributes"] == {"batch.num_tokens": 7, "request.ids": ["a", "b"]}
    assert [e["name"] for e in b["events"]] == ["chunk"] and b["events"][0]["attributes"] == {"chunk.index": 1}
    assert b["start_time_ns"] <= b["events"][0]["time_ns"] <= b["end_time_ns"]
    assert b["status"] == {"code": "UNSET", "description": None}


def test_exception_marks_the_span_as_error(tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = setup_tracing("decode", jsonl_path=path)
    with pytest.raises(RuntimeError):
        with get_tracer(provider, "t").start_as_current_span("decode"):
            raise RuntimeError("kv pull failed")
    shutdown(provider)
    (rec,) = _read(path)
    assert rec["status"]["code"] == "ERROR" and "kv pull failed" in rec["status"]["description"]
    assert [e["name"] for e in rec["events"]] == ["exception"]


def test_concurrent_services_sharing_one_file_keep_lines_whole(tmp_path):
    path = tmp_path / "spans.jsonl"
    providers = [setup_tracing(f"svc{i}", jsonl_path=path) for i in range(2)]
    big = "x" * 20_000  # larger than any stdio buffer, so a split write would show

    def work(provider, n):
        tracer = get_tracer(provider, "t")
        for i in range(n):
            with tracer.start_as_current_span("s", attributes={"i": i, "pad": big}):
                pass

    threads = [threading.Thread(target=work, args=(p, 50)) for p in providers for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in providers:
        shutdown(p)
    recs = _read(path)
    assert len(recs) == 300
    assert sorted(r["resource"]["service.name"] for r in recs) == ["svc0"] * 150 + ["svc1"] * 150


def test_shutdown_is_idempotent_and_closes_the_file(tmp_path):
    provider = setup_tracing("gateway", jsonl_path=tmp_path / "sub" / "spans.jsonl")
    (_, exporter), = _exporters(provider)
    shutdown(provider)
    shutdown(provider)
    assert isinstance(exporter, JsonLinesSpanExporter)
    assert exporter.export([]) is SpanExportResult.FAILURE


def test_no_otlp_exporter_without_endpoint(tmp_path):
    provider = setup_tracing("gateway", jsonl_path=tmp_path / "s.jsonl")
    assert [(cls, type(e)) for cls, e in _exporters(provider)] == [(BatchSpanProcessor, JsonLinesSpanExporter)]
    shutdown(provider)
    bare = setup_tracing("bare")
    assert _exporters(bare) == []
    shutdown(bare)


def test_otlp_exporter_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector.invalid:4318")
    provider = setup_tracing("gateway", jsonl_path=tmp_path / "s.jsonl")
    exporters = _exporters(provider)
    shutdown(provider)  # no span was started, so nothing is sent
    assert [(cls, type(e)) for cls, e in exporters] == [
        (BatchSpanProcessor, JsonLinesSpanExporter), (BatchSpanProcessor, OTLPSpanExporter)]
    assert exporters[1][1]._endpoint == "http://collector.invalid:4318/v1/traces"


@pytest.mark.parametrize("endpoint", ["http://c.invalid:4318", "http://c.invalid:4318/",
                                      "http://c.invalid:4318/v1/traces"])
def test_otlp_exporter_from_argument(endpoint):
    provider = setup_tracing("decode", otlp_endpoint=endpoint)
    ((cls, exporter),) = _exporters(provider)
    shutdown(provider)
    assert cls is BatchSpanProcessor and isinstance(exporter, OTLPSpanExporter)
    assert exporter._endpoint == "http://c.invalid:4318/v1/traces"


def test_providers_are_independent_of_the_global_one(tmp_path):
    from opentelemetry import trace

    before = trace.get_tracer_provider()
    a = setup_tracing("a", jsonl_path=tmp_path / "a.jsonl")
    b = setup_tracing("b", jsonl_path=tmp_path / "b.jsonl")
    with get_tracer(a, "t").start_as_current_span("only-a"):
        pass
    shutdown(a)
    shutdown(b)
    assert trace.get_tracer_provider() is before
    assert [r["name"] for r in _read(tmp_path / "a.jsonl")] == ["only-a"]
    assert (tmp_path / "b.jsonl").read_text() == ""


def test_otel_environment_variables_are_honoured(monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    monkeypatch.setenv("OTEL_SERVICE_NAME", "decode-rack-7")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    provider = setup_tracing("moemesh-decode", otlp_endpoint="http://collector.invalid:4317")
    attrs = provider.resource.attributes
    assert attrs["service.name"] == "decode-rack-7" and attrs["deployment.environment"] == "staging"
    assert [t for t, _ in _exporters(provider)] == [BatchSpanProcessor]
    assert isinstance(_exporters(provider)[0][1], GrpcExporter)
    shutdown(provider)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/protobuf or grpc"):
        setup_tracing("x", otlp_endpoint="http://collector.invalid:4318")
