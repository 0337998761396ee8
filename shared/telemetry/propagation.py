"""Trace context in NATS message headers and HTTP headers.

A sender calls `inject_headers()` inside its span and passes the dict as the NATS `headers=`
(or HTTP headers); the receiver calls `extract_context(msg.headers)` and starts its span with
`context=` that result, so one request stays one trace across services.

Headers go through the global propagator, which `OTEL_PROPAGATORS` sets (default: W3C
trace context and baggage), so a mesh fits the tracing its callers use. A message that
carries several requests' contexts in its body names each by a W3C `traceparent`
(`traceparent_of`), whatever the header format.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

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
