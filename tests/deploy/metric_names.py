"""The metrics the services export, read from their source, for the deployment tests
that check the dashboard's and the alert rules' queries.

A metric is declared as `metrics.counter("name", "doc", ("label", ...))` (or histogram,
gauge) on shared/telemetry/metrics.py's `Metrics`, whose namespace prefixes `moemesh_`;
reading the source's syntax tree finds every one without starting a service.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KINDS = {"counter": "counter", "histogram": "histogram", "gauge": "gauge", "summary": "summary",
         "Counter": "counter", "Histogram": "histogram", "Gauge": "gauge", "Summary": "summary"}
# The labels every moemesh series has beside its own: Prometheus's target labels, and
# model_name, which `Metrics` adds to every sample when it renders them.
TARGET_LABELS = frozenset({"job", "instance", "model_name"})


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed, e.g. moemesh_requests_total
    kind: str  # counter, histogram, gauge, summary
    labels: frozenset[str]

    def series(self) -> dict[str, frozenset[str]]:
        """Each series name Prometheus stores for this metric, with the labels it carries."""
        if self.kind == "histogram":
            return {self.name + "_bucket": self.labels | {"le"}, self.name + "_sum": self.labels,
                    self.name + "_count": self.labels}
        if self.kind == "summary":
            return {self.name + "_sum": self.labels, self.name + "_count": self.labels}
        return {self.name: self.labels}


def _strings(node: ast.AST | None) -> list[str] | None:
    if isinstance(node, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                                       for e in node.elts):
        return [e.value for e in node.elts]
    return None


def exported() -> dict[str, Metric]:
    """Every `moemesh_*` metric declared in services/ and shared/, by exposed name."""
    out: dict[str, Metric] = {}
    for path in [*(REPO / "services").rglob("*.py"), *(REPO / "shared").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0]
            if fn not in KINDS or not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            if fn[0].isupper():  # prometheus_client's own class: only with the moemesh namespace
                ns = kw.get("namespace")
                if not (isinstance(ns, ast.Constant) and ns.value == "moemesh"):
                    continue
            labels = _strings(node.args[2] if len(node.args) > 2 else kw.get("labels", kw.get("labelnames")))
            kind = KINDS[fn]
            name = "moemesh_" + first.value
            if kind == "counter" and not name.endswith("_total"):
                name += "_total"  # prometheus_client exposes every counter with _total
            out[name] = Metric(name, kind, frozenset(labels or ()))
    return out


def series_index(metrics: dict[str, Metric]) -> dict[str, tuple[Metric, frozenset[str]]]:
    """Series name -> (its metric, the labels a selector on it may name)."""
    return {s: (m, labels | TARGET_LABELS) for m in metrics.values() for s, labels in m.series().items()}


_SELECTOR = re.compile(r"\b(moemesh_\w+)\s*(\{[^}]*\})?")
_LABEL = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_RATE = re.compile(r"\b(rate|irate|increase)\(\s*(moemesh_\w+)")


def problems(expr: str, index: dict[str, tuple[Metric, frozenset[str]]]) -> list[str]:
    """What is wrong with the moemesh series one PromQL expression uses: unknown names,
    labels the metric does not have, and rate() over a gauge."""
    out = []
    for name, sel in _SELECTOR.findall(expr):
        if name not in index:
            out.append(f"{name}: no such series")
            continue
        metric, allowed = index[name]
        for label in _LABEL.findall(sel or ""):
            if label not in allowed:
                out.append(f"{name}: no label {label!r} (has {sorted(allowed)})")
    for fn, name in _RATE.findall(expr):
        if name in index and index[name][0].kind == "gauge":
            out.append(f"{fn}({name}): {name} is a gauge")
    return out
