"""Trace context through a headers dict, as it travels in a NATS message or an HTTP request."""

import json
from collections.abc import Mapping

import pytest
from opentelemetry import trace
from opentelemetry.context import Context

from moemesh.shared.telemetry.tracing import extract_context, get_tracer, inject_headers, setup_tracing, shutdown


@pytest.fixture
def two_services(tmp_path):
    path = tmp_path / "spans.jsonl"
    gateway, decode = setup_tracing("gateway", jsonl_path=path), setup_tracing("decode", jsonl_path=path)
    yield get_tracer(gateway, "gateway"), get_tracer(decode, "decode"), path, (gateway, decode)
    shutdown(gateway)
    shutdown(decode)


def _receive(tracer, headers):
    """The receiving side runs outside the sender's context, as it would in another process."""
    with tracer.start_as_current_span("decode", context=extract_context(headers)) as span:
        return span


def test_round_trip_joins_the_senders_trace(two_services):
    gw, dec, path, providers = two_services
    with gw.start_as_current_span("http.request") as sent:
        headers = inject_headers({"request-id": "r1"})
    received = _receive(dec, json.loads(json.dumps(headers)))  # as bytes on the wire would

    assert headers["request-id"] == "r1" and headers["traceparent"].startswith("00-")
    ctx, parent = received.get_span_context(), received.parent
    assert ctx.trace_id == sent.get_span_context().trace_id
    assert parent.span_id == sent.get_span_context().span_id and parent.is_remote
    for p in providers:  # spans are written in batches: read once what ended has gone out
        p.force_flush()
    recs = {r["name"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert recs["decode"]["parent_span_id"] == recs["http.request"]["span_id"]
    assert recs["decode"]["trace_id"] == recs["http.request"]["trace_id"]
    assert recs["decode"]["resource"]["service.name"] == "decode"
    assert recs["http.request"]["resource"]["service.name"] == "gateway"


def test_explicit_context_outside_the_span(two_services):
    gw, dec, *_ = two_services
    span = gw.start_span("queue.wait")
    headers = inject_headers(context=trace.set_span_in_context(span))
    span.end()
    assert _receive(dec, headers).parent.span_id == span.get_span_context().span_id


def test_header_name_case_and_bytes_values(two_services):
    gw, dec, *_ = two_services
    with gw.start_as_current_span("http.request") as sent:
        value = inject_headers()["traceparent"]
    want = sent.get_span_context().span_id
    assert _receive(dec, {"Traceparent": value}).parent.span_id == want
    assert _receive(dec, {"traceparent": value.encode()}).parent.span_id == want


def test_nothing_injected_without_an_active_span():
    assert inject_headers() == {}
    assert inject_headers(context=Context()) == {}


class _Exploding(Mapping):
    def __getitem__(self, key):
        raise RuntimeError("bad transport")

    def __iter__(self):
        raise RuntimeError("bad transport")

    def __len__(self):
        return 1


@pytest.mark.parametrize("headers", [
    None, {}, "traceparent", ["traceparent"], {"traceparent": "garbage"}, {"traceparent": 123},
    {"traceparent": None}, {"traceparent": ["x", None]}, {1: 2}, {"traceparent": b"\xff\xfe"},
    {"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"},
    {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01" + "x" * 600},
    _Exploding(),
])
def test_garbage_headers_give_an_empty_context(headers, two_services):
    gw, dec, *_ = two_services
    ctx = extract_context(headers)
    assert ctx == Context()
    with gw.start_as_current_span("unrelated"):  # empty means "new trace", even inside a span
        assert _receive(dec, headers).parent is None


def test_headers_follow_the_global_propagator(two_services):
    # OTEL_PROPAGATORS picks the global propagator; the mesh's headers follow it
    from opentelemetry import propagate
    from opentelemetry.baggage import set_baggage
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()]))
    try:
        sender = two_services[0]
        with sender.start_as_current_span("send"):
            headers = inject_headers(context=set_baggage("tenant", "acme"))
        assert "baggage" in headers and "tenant=acme" in headers["baggage"]
        propagate.set_global_textmap(W3CBaggagePropagator())  # no trace context at all
        with sender.start_as_current_span("send"):
            assert "traceparent" not in inject_headers()
    finally:
        propagate.set_global_textmap(before)
