"""Prometheus metrics for one service, in a registry of its own.

Tests run several services in one process; on the global registry their metrics would
collide ("Duplicated timeseries"), so every `Metrics` owns a fresh `CollectorRegistry`.
The registry also carries the process's own `process_*`, `python_gc_*` and
`python_info` metrics, and every moemesh metric is rendered with the service's constant
labels (`model_name`, as vLLM labels its metrics) without a call site naming them.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST, GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
    Histogram, generate_latest,
)
from prometheus_client.metrics_core import Metric

# Spans 100 µs (a queue hop, a KV block copy) to 60 s (a long generation) at 1-2.5-5 steps,
# so one bucket set serves every latency the mesh records.
DEFAULT_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                           0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A whole request: an agentic turn with a long answer runs for minutes (vLLM's go to 7680 s).
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 3840.0, 7680.0)


class Metrics:
    """Creates and renders one service's metrics.

    Asking twice for the same name returns the same metric, so modules of one service can
    each declare what they use; asking with another type or other labels is a ValueError.
    """

    def __init__(self, namespace: str = "moemesh", const_labels: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.namespace = namespace
        self.const_labels = dict(const_labels or {})
        self._metrics: dict[str, tuple[type, tuple[str, ...], object]] = {}
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(c)

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS) -> Histogram:
        return self._get(Histogram, name, doc, labels, buckets=tuple(buckets))

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._get(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._get(Gauge, name, doc, labels)

    def render(self) -> tuple[bytes, str]:
        """Returns the `/metrics` body and its Content-Type."""
        return generate_latest(self.exposition()), CONTENT_TYPE_LATEST

    def exposition(self) -> "_Labelled":
        """What a scrape sees (a collector for prometheus_client's exposition functions)."""
        return _Labelled(self.registry, self.namespace + "_", self.const_labels)

    def _get(self, cls: type, name: str, doc: str, labels: Sequence[str], **kw):
        labels = tuple(labels)
        known = self._metrics.get(name)
        if known is not None:
            known_cls, known_labels, metric = known
            if known_cls is not cls or known_labels != labels:
                raise ValueError(f"metric {name!r} already exists as {known_cls.__name__}{known_labels}")
            return metric
        metric = cls(name, doc, labelnames=labels, namespace=self.namespace, registry=self.registry, **kw)
        self._metrics[name] = (cls, labels, metric)
        return metric


class _Labelled:
    """A registry's families with constant labels added to the samples of ours (those named
    with our prefix); the process and runtime families stay as the client library makes them."""

    def __init__(self, registry: CollectorRegistry, prefix: str, labels: dict[str, str]):
        self.registry, self.prefix, self.labels = registry, prefix, labels

    def collect(self):
        for fam in self.registry.collect():
            if not self.labels or not fam.name.startswith(self.prefix):
                yield fam
                continue
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in fam.samples]
            yield out
