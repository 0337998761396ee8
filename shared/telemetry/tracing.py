"""One TracerProvider per service, and the trace context that carries a request's trace
from one service to the next.

Tests run gateway, prefill and decode in one process, so nothing here touches the global
provider: each service calls `setup_tracing`, keeps the provider it gets back, takes its
tracers from it with `get_tracer`, and calls `shutdown` when it stops. Parent/child links
across services still work because the active span lives in the (process-wide) context,
not in a provider.

Span names the services emit (attributes in brackets):
    gateway  "http.request"   [http.method, http.route, http.status_code, request.id]
             "stream"         events: one per chunk sent
    prefill  "queue.wait"     [request.id]
             "prefill.batch"  [batch.num_requests, batch.num_tokens]
             "kv.transfer"    [kv.num_blocks, kv.num_bytes]
    decode   "queue.wait", "kv.transfer"
             "decode"         per request; events: "step", each engine step once, on
                              the span of one request it ran

Trace context rides in NATS message headers and HTTP headers. A sender calls
`inject_headers()` inside its span and passes the dict as the NATS `headers=` (or HTTP
headers); the receiver calls `extract_context(msg.headers)` and starts its span with
`context=` that result, so one request stays one trace across services.

Headers go through the global propagator, which `OTEL_PROPAGATORS` sets (default: W3C
trace context and baggage), so a mesh fits the tracing its callers use. A message that
carries several requests' contexts in its body names each by a W3C `traceparent`
(`traceparent_of`), whatever the header format.
"""

from __future__ import annotations

import os
import random
import weakref
from collections.abc import Mapping, MutableMapping
from contextlib import contextmanager

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import (
    NonRecordingSpan, NoOpTracer, Span, SpanContext, TraceFlags, Tracer, get_current_span, use_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from moemesh.shared.telemetry.jsonl_exporter import JsonLinesSpanExporter

OTLP_TRACES_PATH = "v1/traces"
JSONL_FLUSH_S = 0.2  # a request's spans are in the file this long after it ends, at most
JSONL_QUEUE_SPANS = 65536  # ~40 s of spans at 200 requests/s: a slow disk does not lose any

_shut_down: weakref.WeakSet[TracerProvider] = weakref.WeakSet()
_exporting: weakref.WeakSet[TracerProvider] = weakref.WeakSet()


def setup_tracing(service_name: str, jsonl_path: str | os.PathLike | None = None,
                  otlp_endpoint: str | None = None) -> TracerProvider:
    """Builds a new provider for one service; never installs it globally.

    Args:
        service_name: the `service.name` resource attribute; one process row in a Chrome trace.
        jsonl_path: append finished spans here as JSON lines (see `jsonl_exporter`).
        otlp_endpoint: OTLP collector base URL, e.g. "http://collector:4318"; when None,
            OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT turn OTLP on.
            OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL picks http/protobuf (the default) or grpc
            (then the endpoint is host:port, e.g. "http://collector:4317").
        OTEL_SERVICE_NAME, when set, names the service instead of service_name, and
        OTEL_RESOURCE_ATTRIBUTES adds to the resource, as every OpenTelemetry SDK does.
    Returns:
        The provider. With neither exporter it still creates real spans (and ids to propagate);
        they are simply dropped.
    """
    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(named))
    if jsonl_path is not None:
        # Batched, off the event loop: written as each span ended, a file append per span sat
        # on the request's own path in every service, and at 32 streams on two cores it
        # doubled the time to first token. Batches go every JSONL_FLUSH_S, and at shutdown.
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(jsonl_path),
                                                       max_queue_size=JSONL_QUEUE_SPANS,
                                                       schedule_delay_millis=JSONL_FLUSH_S * 1e3))
    otlp = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") \
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if otlp:
        # Batched: a network round trip per span would stall the event loop.
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(otlp_endpoint)))
    if jsonl_path is not None or otlp:
        _exporting.add(provider)
    return provider


def otlp_protocol() -> str:
    p = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") \
        or "http/protobuf"
    if p not in ("http/protobuf", "grpc"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={p!r}: moemesh exports over http/protobuf or grpc")
    return p


def _otlp_exporter(endpoint: str | None):
    # Imported here so that services without a collector do not load an HTTP or gRPC stack.
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint)  # gRPC takes the base address; None: the env vars
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=_traces_url(endpoint))


def exports_spans(provider: TracerProvider | None) -> bool:
    """Whether spans leave the process: detail that only a trace shows (per-step events)
    is worth its cost then."""
    return provider is not None and provider in _exporting


def _traces_url(endpoint: str | None) -> str | None:
    """The exporter wants the full signal URL, while the env var convention is a base URL."""
    if not endpoint:
        return None  # the exporter resolves the env vars itself
    if endpoint.rstrip("/").endswith("/" + OTLP_TRACES_PATH):
        return endpoint
    return endpoint.rstrip("/") + "/" + OTLP_TRACES_PATH


def get_tracer(provider: TracerProvider, name: str, root: bool = False) -> Tracer:
    """The service's tracer. A worker whose spans go nowhere gets a no-op tracer: its spans
    cost nothing, and the context it was handed still passes through to the services it
    calls. root: the service that starts traces (the gateway) records its spans always,
    so that trace ids exist for the services after it."""
    if exports_spans(provider):
        return provider.get_tracer(name)
    return ContextOnlyTracer() if root else NoOpTracer()


class ContextOnlyTracer(NoOpTracer):
    """For a service that starts traces but exports nothing: its spans record nothing,
    yet each has a fresh, sampled span context (in the trace it was handed, or a new
    one), so that services after it which do export see one trace per request."""

    def start_span(self, name, context=None, *args, **kwargs) -> Span:
        parent = get_current_span(context).get_span_context()
        trace_id = parent.trace_id if parent.is_valid else random.getrandbits(128) or 1
        return NonRecordingSpan(SpanContext(trace_id, random.getrandbits(64) or 1, is_remote=False,
                                            trace_flags=TraceFlags(TraceFlags.SAMPLED)))

    @contextmanager
    def start_as_current_span(self, name, context=None, *args, end_on_exit: bool = True, **kwargs):
        with use_span(self.start_span(name, context), end_on_exit=end_on_exit) as span:
            yield span


def shutdown(provider: TracerProvider) -> None:
    """Exports what is still queued, then closes every exporter; safe to call twice."""
    if provider in _shut_down:
        return
    _shut_down.add(provider)
    provider.shutdown()


_PROPAGATOR = TraceContextTextMapPropagator()


class _HeaderGetter(Getter[Mapping]):
    """Reads a header whatever the case of its name or the type of its value.

    NATS headers are a plain, case-sensitive dict, and a peer may write `Traceparent`;
    HTTP header names are case-insensitive; some transports hand over bytes.
    """

    def get(self, carrier: Mapping, key: str) -> list[str] | None:
        val = carrier.get(key)
        if val is None:
            val = next((v for k, v in carrier.items() if isinstance(k, str) and k.lower() == key), None)
        if isinstance(val, (bytes, str)):
            val = [val]
        if not isinstance(val, (list, tuple)):
            return None
        out = [v.decode("latin-1") if isinstance(v, bytes) else v for v in val]
        return out if all(isinstance(v, str) for v in out) and out else None

    def keys(self, carrier: Mapping) -> list[str]:
        return [k for k in carrier if isinstance(k, str)]


_GETTER = _HeaderGetter()


def inject_headers(headers: MutableMapping[str, str] | None = None, context: Context | None = None) -> dict:
    """Writes the trace context of `context` (default: the current one) into `headers`.

    Args:
        headers: updated in place; a new dict when None.
        context: whose active span becomes the remote parent; the current context when None.
    Returns:
        `headers`, with `traceparent` (and `tracestate` when set) added; nothing is added
        when there is no valid active span.
    """
    if headers is None:
        headers = {}
    propagate.get_global_textmap().inject(headers, context=context)
    return headers


def extract_context(headers: Mapping | None) -> Context:
    """The context carried by `headers`; an empty context when it is missing or malformed.

    Never raises: a bad header from a peer must not fail the request it came with.
    """
    if not isinstance(headers, Mapping):
        return Context()
    try:
        return propagate.get_global_textmap().extract(headers, getter=_GETTER)
    except Exception:  # any parse failure just means "no parent"
        return Context()


def traceparent_of(span) -> str:
    """The `traceparent` value naming `span` as parent ("" when it has no valid context),
    for messages that carry several requests' contexts in their body."""
    headers: dict = {}
    _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
    return headers.get("traceparent", "")
