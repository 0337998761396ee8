"""The Grafana dashboard and the Prometheus alert rules: provisioned as compose runs them,
shaped as Grafana and Prometheus read them, and asking only for series the services
export, with labels those series have."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.metric_names import exported, problems, series_index

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "moemesh.json"
ALERTS = COMPOSE / "prometheus" / "alerts.yml"
JOBS = {"gateway", "prefill", "decode", "balancer", "kv-store"}  # the moemesh scrape jobs
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")  # Prometheus's duration syntax


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def index():
    return series_index(exported())


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p["targets"]]


# ---- the metric catalogue itself ----------------------------------------------------------

def test_the_catalogue_reads_the_services_metrics():
    have = exported()
    assert have["moemesh_ttft_seconds"].kind == "histogram"
    assert have["moemesh_requests_total"].labels == {"route", "status"}
    assert have["moemesh_prefix_cache_hit_tokens_total"].kind == "counter"  # a doc string over two lines
    assert have["moemesh_eplb_layer_balance_ratio"].labels == {"instance", "layer"}
    assert have["moemesh_kv_cache_usage_ratio"].kind == "gauge"  # set_function: read at scrape time


def test_problems_finds_unknown_names_labels_and_rates_of_gauges(index):
    assert problems('sum(rate(moemesh_requests_total{status=~"5.."}[5m]))', index) == []
    assert problems('moemesh_ttft_seconds_bucket{le="1", model_name="m"}', index) == []
    assert problems("rate(moemesh_no_such_total[5m])", index) == ["moemesh_no_such_total: no such series"]
    assert problems('moemesh_requests_total{code="500"}', index)[0].startswith("moemesh_requests_total: no label 'code'")
    assert problems("rate(moemesh_inflight_requests[1m])", index) == [
        "rate(moemesh_inflight_requests): moemesh_inflight_requests is a gauge"]


# ---- Grafana -------------------------------------------------------------------------------

def test_grafana_is_provisioned_in_compose(compose):
    g = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in g["volumes"] if v.startswith("./"))
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/moemesh.yml").read_text())
    (p,) = provider["providers"]
    assert mounts["./grafana/dashboards"] == p["options"]["path"]  # the provider reads the mounted JSON
    assert g["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == p["options"]["path"] + "/moemesh.json"
    assert all(port.startswith("127.0.0.1:") for port in g["ports"])
    assert g["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert g["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"  # anonymous visitors only look


def test_the_datasource_is_the_compose_prometheus(compose, dashboard):
    (ds,) = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", ds["url"]).groups()
    assert host in compose["services"] and any(p.endswith(":" + port) for p in compose["services"][host]["ports"])
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert var["current"]["value"] == ds["uid"] and ds["type"] == var["query"] == "prometheus"


def test_the_dashboard_has_every_panel_the_operator_needs(dashboard):
    """TTFT, ITL, throughput, KV usage, prefix hit rate, balance ratio per layer, KV
    transfer time, host time per step: each a panel over the series that measures it."""
    need = {
        "ttft": "moemesh_ttft_seconds_bucket",
        "itl": "moemesh_inter_token_latency_seconds_bucket",
        "throughput": "moemesh_output_tokens_total",
        "kv usage": "moemesh_kv_cache_usage_ratio",
        "prefix hit rate": "moemesh_prefix_cache_hit_tokens_total",
        "balance per layer": "moemesh_eplb_layer_balance_ratio",
        "kv transfer time": "moemesh_kv_pull_seconds_bucket",
        "host time per step": 'moemesh_step_phase_seconds_sum{phase=~"host',
    }
    exprs = _exprs(dashboard)
    for what, series in need.items():
        assert any(series in e for e in exprs), what
    (layers,) = [p for p in _panels(dashboard) if "moemesh_eplb_layer_balance_ratio" in p["targets"][0]["expr"]]
    assert "{{layer}}" in layers["targets"][0]["legendFormat"]  # one bar per layer


def test_every_dashboard_query_names_real_series(dashboard, index):
    bad = {e: problems(e, index) for e in _exprs(dashboard)}
    assert {e: p for e, p in bad.items() if p} == {}


def test_the_dashboard_is_well_formed(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]
    defined = {v["name"] for v in dashboard["templating"]["list"]} | {"__rate_interval", "__all"}
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    for p in _panels(dashboard):
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\$\{?(\w+)", t["expr"]))
            assert used <= defined, (p["title"], used - defined)
            assert t["expr"].count("(") == t["expr"].count(")"), p["title"]


# ---- Prometheus alert rules ----------------------------------------------------------------

def test_prometheus_loads_the_rules(compose):
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["alerts.yml"]
    vols = compose["services"]["prometheus"]["volumes"]
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in vols  # beside prometheus.yml
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in vols
    assert {j["job_name"] for j in prom["scrape_configs"]} >= JOBS


def test_every_rule_is_complete(rules):
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, r["alert"]
        assert r["alert"].startswith("Moemesh") and r["expr"].strip(), r["alert"]
        assert DURATION.match(r.get("for", "0s")), r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        assert {"summary", "description"} <= set(r["annotations"]), r["alert"]


def test_the_rules_cover_what_an_operator_is_paged_for(rules):
    exprs = " ".join(r["expr"] for r in rules)
    for needle in ('up{job="gateway"}', 'up{job="decode"}', "moemesh_ttft_seconds_bucket",
                   'moemesh_requests_total{status=~"5.."}', "moemesh_kv_cache_usage_ratio",
                   "moemesh_eplb_balance_ratio", "moemesh_request_migrations_total", "moemesh_token_gaps_total"):
        assert needle in exprs, needle


def test_every_rule_names_real_series_and_jobs(rules, index):
    for r in rules:
        assert problems(r["expr"], index) == [], r["alert"]
        jobs = set(re.findall(r'job=~?"([^"]+)"', r["expr"]))
        for j in jobs:
            assert set(j.split("|")) <= JOBS, (r["alert"], j)


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (.ci/run takes it from Debian's prometheus package)")
    return exe


def test_promtool_accepts_the_config_and_rules(tmp_path):
    exe = _promtool()
    for f in ("prometheus.yml", "alerts.yml"):
        shutil.copy(COMPOSE / "prometheus" / f, tmp_path / f)
    r = subprocess.run([exe, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr


def test_the_rules_fire_when_they_should(tmp_path):
    """tests/deploy/alerts.test.yml through `promtool test rules`: each scenario's alerts,
    and none in a healthy mesh. The rules are the shipped ones less their annotations
    (promtool compares annotations verbatim; `check config` has parsed their templates)."""
    exe = _promtool()
    doc = yaml.safe_load(ALERTS.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(doc))
    shutil.copy(Path(__file__).with_name("alerts.test.yml"), tmp_path / "alerts.test.yml")
    r = subprocess.run([exe, "test", "rules", str(tmp_path / "alerts.test.yml")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_promtool_scenarios_cover_every_rule(rules):
    tests = yaml.safe_load(Path(__file__).with_name("alerts.test.yml").read_text())
    fired = {c["alertname"] for t in tests["tests"] for c in t.get("alert_rule_test", []) if c.get("exp_alerts")}
    assert fired == {r["alert"] for r in rules}
