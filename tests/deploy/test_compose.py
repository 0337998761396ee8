"""compose/docker-compose.yml: valid for docker-compose in both profiles, and shaped as
the deployment needs (health-ordered start, healthchecks, secrets, telemetry wiring)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
MOEMESH = {"prefill", "decode", "gateway", "balancer", "kv-store", "prefill-gpu", "decode-gpu", "gateway-gpu"}
PASSWORDS = ["GATEWAY", "PREFILL_0", "DECODE_0", "BALANCER", "KV_STORE", "OPS"]
WORKER_IDS = {"prefill": "prefill-0", "decode": "decode-0", "gateway": "gateway", "balancer": "balancer",
              "kv-store": "kv_store"}


@pytest.fixture(scope="module")
def spec() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


@pytest.fixture
def env_file(tmp_path) -> Path:
    keys = tmp_path / "api_keys"
    keys.write_text("sk-test\n")
    lines = [f"{n}_NATS_PASSWORD=pw-{n.lower()}" for n in PASSWORDS] + [f"MOEMESH_API_KEYS_FILE={keys}",
                                                                        "GRAFANA_ADMIN_PASSWORD=pw-grafana"]
    p = tmp_path / "test.env"
    p.write_text("\n".join(lines) + "\n")
    return p


def _compose(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose; .ci/run tries)")
    return subprocess.run([exe, "-f", str(COMPOSE / "docker-compose.yml"), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_config_accepts_it(env_file, profile):
    r = _compose("--env-file", str(env_file), "--profile", profile, "config", "-q")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("preset", ["", "v4-tiny"])
def test_the_cpu_profile_makes_and_serves_the_chosen_preset(env_file, preset):
    """MOEMESH_CPU_PRESET=v4-tiny runs the cpu profile on a DeepSeek-V4 model; unset, the V3-shaped tiny."""
    r = _compose("--env-file", str(env_file), "--profile", "cpu", "config",
                 env={"MOEMESH_CPU_PRESET": preset})  # empty: as if unset
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    want = preset or "tiny"
    init = " ".join(services["model-init"]["command"])
    assert f"init-model /models/{want} --preset {want}" in init and f"test -f /models/{want}/config.json" in init
    for name in ("prefill", "decode", "gateway"):
        env = services[name]["environment"]
        assert env["MOEMESH_MODEL"] == f"/models/{want}" and env["MOEMESH_SERVED_MODEL_NAME"] == want, name


def test_docker_compose_refuses_to_run_without_passwords(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    r = _compose("--env-file", str(empty), "config", "-q")
    assert r.returncode != 0 and "NATS_PASSWORD" in r.stderr


def test_every_moemesh_service_is_healthchecked_and_waits_for_healthy_nats(spec):
    services = spec["services"]
    assert MOEMESH <= set(services)
    for name in MOEMESH:
        s = services[name]
        test = " ".join(s["healthcheck"]["test"])
        assert "/health" in test, name
        assert (":8000/health" in test) == name.startswith("gateway"), name  # workers: their metrics_port
        assert s["depends_on"]["nats"] == {"condition": "service_healthy"}, name
        assert s["stop_signal"] == "SIGTERM" and s["read_only"] is True, name
        assert "python -m moemesh.services." + name.split("-gpu")[0].replace("-", "_") in " ".join(s["command"]), name
        assert any(str(v).startswith("./moemesh.toml:") and str(v).endswith(":ro") for v in s["volumes"]), name
    assert "healthcheck" in services["nats"]
    for gw, workers in (("gateway", ("prefill", "decode")), ("gateway-gpu", ("prefill-gpu", "decode-gpu"))):
        for w in workers:
            assert services[gw]["depends_on"][w] == {"condition": "service_healthy"}
    assert services["decode"]["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}


def test_profiles_split_cpu_and_gpu_workers(spec):
    services = spec["services"]
    for name in ("model-init", "prefill", "decode", "gateway"):
        assert services[name]["profiles"] == ["cpu"]
    for name in ("prefill-gpu", "decode-gpu"):
        s = services[name]
        assert s["profiles"] == ["gpu"]
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"]
        assert any(v.endswith(":/checkpoint:ro") for v in s["volumes"])  # the real checkpoint, read-only
        assert s["image"].endswith("-gpu") and "cu" in s["build"]["args"]["TORCH_INDEX_URL"]
    assert "profiles" not in services["balancer"] and "profiles" not in services["kv-store"]


def test_only_the_api_and_loopback_ports_are_published(spec):
    for name, s in spec["services"].items():
        for port in s.get("ports", []):
            assert port.startswith("127.0.0.1:") or (name.startswith("gateway") and port.endswith(":8000")), \
                (name, port)


def test_nats_gets_every_password_and_services_only_their_own(spec):
    env = spec["services"]["nats"]["environment"]
    assert {f"{n}_NATS_PASSWORD" for n in PASSWORDS} <= set(env)
    for name in MOEMESH:
        env = spec["services"][name]["environment"]
        wid = WORKER_IDS[name.split("-gpu")[0]]  # each container is one worker, and its own NATS user
        assert env["MOEMESH_WORKER_ID"] == env["MOEMESH_NATS_USER"] == wid, name
        own = wid.replace("-", "_").upper()
        assert env["MOEMESH_NATS_PASSWORD"].startswith(f"${{{own}_NATS_PASSWORD"), name


def test_telemetry_is_wired(spec):
    collector = yaml.safe_load((COMPOSE / "otel" / "collector.yaml").read_text())
    traces = collector["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    (exporter,) = traces["exporters"]
    assert collector["exporters"][exporter]["endpoint"].startswith("jaeger:")
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    scraped = {n for job in prom["scrape_configs"] for sd in job.get("dns_sd_configs", []) for n in sd["names"]}
    assert {"gateway", "prefill", "decode", "balancer", "kv-store"} <= scraped
    assert {"otel-collector", "jaeger", "prometheus"} <= set(spec["services"])
