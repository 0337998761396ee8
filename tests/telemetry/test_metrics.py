"""Per-service Prometheus registries and the /metrics text they render."""

import pytest

from moemesh.shared.telemetry.metrics import DEFAULT_LATENCY_BUCKETS, Metrics


def test_render_contains_the_histogram():
    m = Metrics()
    h = m.histogram("ttft_seconds", "time to first token", labels=("model",))
    h.labels(model="tiny").observe(0.0003)
    h.labels(model="tiny").observe(12.0)
    m.counter("requests", "requests served").inc(3)
    m.gauge("num_running", "running sequences").set(5)
    body, content_type = m.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    assert "# TYPE moemesh_ttft_seconds histogram" in text
    assert 'moemesh_ttft_seconds_bucket{le="0.0005",model="tiny"} 1.0' in text
    assert 'moemesh_ttft_seconds_bucket{le="10.0",model="tiny"} 1.0' in text
    assert 'moemesh_ttft_seconds_bucket{le="+Inf",model="tiny"} 2.0' in text
    assert 'moemesh_ttft_seconds_count{model="tiny"} 2.0' in text
    assert "moemesh_requests_total 3.0" in text and "moemesh_num_running 5.0" in text


def test_default_buckets_cover_microseconds_to_a_minute():
    assert list(DEFAULT_LATENCY_BUCKETS) == sorted(DEFAULT_LATENCY_BUCKETS)
    assert DEFAULT_LATENCY_BUCKETS[0] <= 0.0005 and DEFAULT_LATENCY_BUCKETS[-1] >= 60


def test_services_in_one_process_do_not_clash():
    a, b = Metrics(), Metrics()
    a.counter("requests", "r").inc()
    b.counter("requests", "r").inc(2)  # on the global registry this would raise
    assert b"moemesh_requests_total 1.0" in a.render()[0]
    assert b"moemesh_requests_total 2.0" in b.render()[0]


def test_same_name_returns_the_same_metric_and_conflicts_raise():
    m = Metrics(namespace="")
    assert m.histogram("step_seconds", "s") is m.histogram("step_seconds", "s")
    with pytest.raises(ValueError, match="step_seconds"):
        m.counter("step_seconds", "s")
    with pytest.raises(ValueError, match="step_seconds"):
        m.histogram("step_seconds", "s", labels=("phase",))
    m.histogram("step_seconds", "s").observe(1)
    assert b"\nstep_seconds_count 1.0" in m.render()[0]


def test_the_metrics_server_serves_prometheus_own_exposition_and_health():
    import asyncio

    import httpx

    from moemesh.shared.service.metrics_http import MetricsServer

    async def go():
        m = Metrics(const_labels={"model_name": "tiny"})
        m.counter("requests", "requests served").inc(2)
        async with MetricsServer(m, lambda: {"status": "ok", "role": "decode"}, "127.0.0.1", 0) as srv:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}", timeout=10) as c:
                text = await c.get("/metrics", headers={"Accept-Encoding": "identity"})
                zipped = await c.get("/metrics", headers={"Accept-Encoding": "gzip"})
                om = await c.get("/metrics", headers={"Accept": "application/openmetrics-text"})
                health = await c.get("/health")
                missing = await c.get("/nothing")
        return text, zipped, om, health, missing

    text, zipped, om, health, missing = asyncio.run(go())
    assert 'moemesh_requests_total{model_name="tiny"} 2.0' in text.text
    assert zipped.headers.get("content-encoding") == "gzip" or "moemesh_requests_total" in zipped.text
    assert om.headers["content-type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n")
    assert health.json() == {"status": "ok", "role": "decode"} and missing.status_code == 404


def test_a_draining_worker_is_alive_but_not_ready():
    from starlette.testclient import TestClient

    from moemesh.shared.service.metrics_http import build_app

    state = {"status": "ok", "role": "decode", "draining": False}
    c = TestClient(build_app(Metrics(), lambda: dict(state)))
    assert c.get("/health/ready").status_code == 200
    state["draining"] = True
    assert c.get("/health").status_code == 200  # liveness must not restart it mid-drain
    ready = c.get("/health/ready")
    assert ready.status_code == 503 and ready.json()["draining"] is True
