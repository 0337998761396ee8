"""Prometheus metrics for one service, in a registry of its own.

Tests run several services in one process; on the global registry their metrics would
collide ("Duplicated timeseries"), so every `Metrics` owns a fresh `CollectorRegistry`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Spans 100 µs (a queue hop, a KV block copy) to 60 s (a long generation) at 1-2.5-5 steps,
# so one bucket set serves every latency the mesh records.
DEFAULT_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                           0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Creates and renders one service's metrics.

    Asking twice for the same name returns the same metric, so modules of one service can
    each declare what they use; asking with another type or other labels is a ValueError.
    """

    def __init__(self, namespace: str = "moemesh") -> None:
        self.registry = CollectorRegistry()
        self.namespace = namespace
        self._metrics: dict[str, tuple[type, tuple[str, ...], object]] = {}

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS) -> Histogram:
        return self._get(Histogram, name, doc, labels, buckets=tuple(buckets))

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._get(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._get(Gauge, name, doc, labels)

    def render(self) -> tuple[bytes, str]:
        """Returns the `/metrics` body and its Content-Type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

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
