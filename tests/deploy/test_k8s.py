"""compose/k8s: every object valid for Kubernetes (kubernetes-validate's schemas, strict),
and the manifests consistent with the mesh they deploy: every service runs, each worker
has the NATS user and the password `moemesh nats-auth` gives it and no other, the DEP
ranks find their rank and rendezvous, probes hit endpoints the services serve, and the
ConfigMap's deployment file is valid for every service with each pod's environment."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate as kv  # a test dependency (pyproject.toml); it ships the schemas
import pytest
import yaml

from moemesh.shared.config.loader import load
from moemesh.tools.cli.main import main as cli_main
from moemesh.tools.launch.nats_auth import identities
from moemesh.tools.launch.up import password_env, up_config, worker_names
from tests.deploy.kustomize import (container, deployment_file, env_of, one, pod_env, ranks, render, secret_keys,
                                    worker_ids, workloads, write_secrets)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "compose" / "k8s"
# 1.28: the first release that labels StatefulSet pods with their index (decode's dp_rank).
KUBERNETES_VERSIONS = ["1.28.0", kv.latest_version()]
SERVICES = {"gateway": "gateway", "prefill": "prefill", "decode": "decode", "balancer": "balancer",
            "kv-store": "kv_store"}  # component label -> python -m moemesh.services.<module>
CONFIG = "/etc/moemesh/moemesh.toml"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of compose/k8s with its secrets written (the checkout never holds them)."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("secrets"))
    write_secrets(root)
    return root


@pytest.fixture(scope="module")
def objects(tree) -> list[dict]:
    return render(tree)


def assert_valid(o: dict, version: str) -> None:
    """Strict: a field the schema does not know is an error, as `kubectl apply` makes it."""
    try:
        kv.validate(o, version, strict=True)
        return
    except kv.ValidationError as e:  # its str() carries the whole schema
        why = f"{'.'.join(map(str, e.path))}: {e.message[:300]}"
    pytest.fail(f"{o['kind']}/{o['metadata']['name']} (Kubernetes {version}): {why}", pytrace=False)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_for_kubernetes(objects, version):
    assert len(objects) >= 15
    for o in objects:
        assert_valid(o, version)


def test_the_validator_rejects_what_kubernetes_would(objects):
    gateway = one(objects, "Deployment", "gateway")
    typo = {**gateway, "spec": {**gateway["spec"], "replica": 1}}
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, KUBERNETES_VERSIONS[0], strict=True)
    c = dict(container(gateway), readinessProbe={"httpGet": {"path": "/health/ready"}})  # no port
    pod = {**gateway["spec"]["template"]["spec"], "containers": [c]}
    broken = {**gateway, "spec": {**gateway["spec"], "template": {**gateway["spec"]["template"], "spec": pod}}}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_kustomize_builds_the_objects_the_tests_check(tree, objects):
    """`kubectl kustomize` (where kubectl is installed) makes the same objects as `render`,
    but for the hash suffixes of generated names, and they are valid too."""
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not installed")
    r = subprocess.run([exe, "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    built = [d for d in yaml.safe_load_all(r.stdout) if d]
    generated = {g for o in objects if o["kind"] in ("ConfigMap", "Secret") for g in [o["metadata"]["name"]]}
    text = yaml.safe_dump_all(built)
    for g in generated:
        text = re.sub(rf"\b{g}-[a-z0-9]{{10}}\b", g, text)
    norm = list(yaml.safe_load_all(text))
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, norm)) == sorted(map(key, objects))
    mine = {key(o): o for o in objects}
    for o in norm:
        if o["kind"] in ("Deployment", "StatefulSet", "Service"):
            assert o["spec"] == mine[key(o)]["spec"], key(o)
        assert_valid(o, KUBERNETES_VERSIONS[-1])


# ---- the mesh it deploys ------------------------------------------------------------------

def test_every_service_of_the_mesh_runs(objects):
    services = {p.parent.name for p in (REPO / "services").glob("*/__main__.py")}
    assert set(SERVICES.values()) == services, "a service without a manifest, or a manifest without a service"
    by_role = {}
    for w in workloads(objects):
        role = w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        by_role.setdefault(role, []).append(w)
        argv = " ".join(container(w).get("command", []) + container(w).get("args", []))
        assert f"python -m moemesh.services.{SERVICES[role]} --config {CONFIG}" in argv, w["metadata"]["name"]
    assert set(by_role) == set(SERVICES)
    assert [w["kind"] for w in by_role["decode"]] == ["StatefulSet"]


def test_the_pods_are_the_workers_of_the_deployment_file(objects, tmp_path):
    """One pod per worker that [pools] names, each with that worker's id; one identity
    never runs twice (replicas 1 and Recreate for the single workers)."""
    (tmp_path / "moemesh.toml").write_text(deployment_file(objects))
    want = sorted(w.worker_id for w in worker_names(up_config(str(tmp_path / "moemesh.toml"))))
    have = []
    for w in workloads(objects):
        have += worker_ids(w)
        if w["kind"] == "Deployment":
            assert w["spec"]["replicas"] == 1 and w["spec"]["strategy"]["type"] == "Recreate", w["metadata"]["name"]
    assert sorted(have) == want


def test_nats_auth_conf_is_what_moemesh_nats_auth_writes(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli_main(["nats-auth", "--config", "compose/k8s/moemesh.toml"]) == 0
    assert capsys.readouterr().out == (K8S / "nats" / "auth.conf").read_text()


def test_the_secret_holds_a_password_for_every_nats_user(objects, tmp_path):
    (tmp_path / "moemesh.toml").write_text(deployment_file(objects))
    users = identities(up_config(str(tmp_path / "moemesh.toml")))
    assert secret_keys(objects, "moemesh-nats-passwords") == {password_env(u.worker_id) for u in users}
    nats = container(one(objects, "StatefulSet", "nats"))
    assert nats["envFrom"] == [{"secretRef": {"name": "moemesh-nats-passwords"}}]  # the server reads them all


def test_each_worker_connects_as_itself_with_only_its_own_password(objects):
    for w in workloads(objects):
        c, spec = container(w), w["spec"]["template"]["spec"]
        assert "envFrom" not in c, w["metadata"]["name"]
        env = env_of(c)
        for r in ranks(w):
            literal = pod_env(w, r)
            assert literal["MOEMESH_NATS_USER"] == literal["MOEMESH_WORKER_ID"], w["metadata"]["name"]
        ids = worker_ids(w)
        if "MOEMESH_NATS_PASSWORD" in env:  # a single worker: a secretKeyRef to its own key
            (wid,) = ids
            ref = env["MOEMESH_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "moemesh-nats-passwords", "key": password_env(wid)}, wid
            continue
        # DEP ranks share a template: a volume of the instance's own passwords, one file
        # per worker id, and the rank reads the file named by its id.
        (vol,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "moemesh-nats-passwords"]
        items = {i["key"]: i["path"] for i in vol["secret"]["items"]}
        assert items == {password_env(i): i for i in ids}, w["metadata"]["name"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
        assert f'MOEMESH_NATS_PASSWORD="$(cat "{mount["mountPath"]}/$MOEMESH_WORKER_ID")"' in " ".join(c["args"])
        assert "export MOEMESH_NATS_PASSWORD" in c["args"][0] and "exec python" in c["args"][0]
    for o in objects:  # the API keys go to the gateway alone
        if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["name"] != "gateway":
            vols = o["spec"]["template"]["spec"].get("volumes", [])
            assert not any(v.get("secret", {}).get("secretName") == "moemesh-api-keys" for v in vols)


def test_decode_ranks_get_their_rank_and_a_stable_rendezvous(objects):
    from moemesh.services.decode.config import DecodeConfig

    sts = one(objects, "StatefulSet", "decode-i0")
    svc = one(objects, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # rank 0 is ready only once all have joined
    toml = K8S / "moemesh.toml"
    for r in ranks(sts):
        cfg = load(DecodeConfig, "decode", toml, environ=pod_env(sts, r))
        assert (cfg.dp_rank, cfg.dp_size, cfg.instance) == (r, sts["spec"]["replicas"], sts["metadata"]["name"])
        assert cfg.worker_id == f"{cfg.instance}-r{r}"  # nats-auth's name for the rank
        host, port = re.fullmatch(r"tcp://([\w.-]+):(\d+)", cfg.dist_init).groups()
        assert host == f"{sts['metadata']['name']}-0.{svc['metadata']['name']}"  # pod 0, through the Service
        assert int(port) in {p["containerPort"] for p in container(sts)["ports"]}
        assert int(port) in {p["port"] for p in svc["spec"]["ports"]}


def _load_all(objects, tmp_path) -> list[tuple[dict, int, object]]:
    from tests.deploy.test_up_config import _service_configs

    classes = dict(_service_configs())
    toml = tmp_path / "moemesh.toml"
    toml.write_text(deployment_file(objects))
    keys = tmp_path / "api_keys"
    keys.write_text("sk-test\n")
    out = []
    for w in workloads(objects):
        section = SERVICES[w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]]
        for r in ranks(w):
            env = {k: v for k, v in pod_env(w, r).items() if k.startswith("MOEMESH_")}
            out.append((w, r, load(classes[section], section, toml, environ=env)))
    return out


def test_the_configmap_toml_is_valid_for_every_pod(objects, tmp_path):
    """Each pod's service loads the ConfigMap's file with the pod's environment: the NATS
    URL is the nats Service, metrics and probes agree on the port, and files it names are
    where the pod mounts them."""
    nats = one(objects, "Service", "nats")
    loaded = _load_all(objects, tmp_path)
    assert {w["metadata"]["name"] for w, _, _ in loaded} >= {"gateway", "prefill-0", "decode-i0", "balancer",
                                                              "kv-store"}
    for w, _, cfg in loaded:
        name = w["metadata"]["name"]
        host, port = re.fullmatch(r"nats://([\w.-]+):(\d+)", cfg.nats_url).groups()
        assert host == nats["metadata"]["name"] and int(port) in {p["port"] for p in nats["spec"]["ports"]}, name
        assert cfg.nats_password == ""  # from the Secret at start, never the file
        ports = {p["name"]: p["containerPort"] for p in container(w)["ports"]}
        assert ports["metrics"] == cfg.metrics_port and cfg.metrics_host == "0.0.0.0", name
        mounts = {m["mountPath"]: m for m in container(w)["volumeMounts"]}
        assert mounts["/etc/moemesh"]["readOnly"] and CONFIG.startswith("/etc/moemesh/"), name
        if getattr(cfg, "model", "") and name != "balancer" and name != "kv-store":
            assert any(cfg.model.startswith(m + "/") for m in mounts), name
        if getattr(cfg, "api_keys_file", ""):
            assert ports["http"] == cfg.port
            assert any(cfg.api_keys_file.startswith(m + "/") for m in mounts), name


def test_probes_point_at_endpoints_the_services_serve(objects, tmp_path):
    from moemesh.services.gateway.http.app import build_app
    from moemesh.services.gateway.http.auth import OPEN_PATHS
    from starlette.testclient import TestClient

    from moemesh.shared.service import metrics_http
    from moemesh.shared.telemetry.metrics import Metrics

    # What a worker, the balancer and the KV store serve on metrics_port.
    worker = TestClient(metrics_http.build_app(Metrics(), lambda: {"status": "ok"}))

    for w, r, cfg in _load_all(objects, tmp_path):
        if r:
            continue
        c = container(w)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        probes = {k: c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}, w["metadata"]["name"]
        if w["metadata"]["name"] == "gateway":
            cfg = type(cfg)(**{**cfg.__dict__, "api_keys_file": str(tmp_path / "api_keys")})
            routes = {route.path for route in build_app(cfg).routes if "GET" in (route.methods or ())}
            assert probes["readinessProbe"]["path"] == "/health/ready" and probes["livenessProbe"]["path"] == "/health"
            for p in probes.values():
                assert ports[p["port"]] == cfg.port and p["path"] in routes and p["path"] in OPEN_PATHS
        else:
            for p in probes.values():
                assert ports[p["port"]] == cfg.metrics_port, w["metadata"]["name"]
                assert worker.get(p["path"]).status_code == 200, (w["metadata"]["name"], p["path"])
    for o in objects:  # no probe names a port its container does not have
        if o["kind"] in ("Deployment", "StatefulSet"):
            for c in o["spec"]["template"]["spec"]["containers"]:
                names = {p["name"] for p in c["ports"]}
                for k in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if k in c:
                        assert c[k]["httpGet"]["port"] in names, (o["metadata"]["name"], k)


def test_workers_get_a_gpu_and_nothing_else_does(objects):
    for w in workloads(objects):
        c = container(w)
        role = w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        if role in ("prefill", "decode"):
            assert gpus == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1, role
            assert c["image"].endswith("-gpu"), role
            assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in w["spec"]["template"]["spec"]["volumes"])
        else:
            assert gpus is None and "nvidia.com/gpu" not in c["resources"].get("requests", {}), role


def test_ucx_runs_on_the_pod_network(objects, tmp_path):
    for w, _, cfg in _load_all(objects, tmp_path):
        if hasattr(cfg, "ucx_net_devices"):  # every service that moves KV bytes
            assert cfg.ucx_net_devices == "eth0" and cfg.ucx_tls == "tcp", w["metadata"]["name"]
    env = env_of(container(one(objects, "StatefulSet", "decode-i0")))
    assert env["GLOO_SOCKET_IFNAME"]["value"] == env["NCCL_SOCKET_IFNAME"]["value"] == "eth0"


def test_every_pod_passes_the_restricted_pod_security_standard(objects):
    ns = one(objects, "Namespace", "moemesh")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for o in objects:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = o["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False, o["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not spec.get("hostNetwork") and not spec.get("hostIPC") and not spec.get("hostPID")
        assert not any("hostPath" in v for v in spec.get("volumes", []))
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                          "capabilities": {"drop": ["ALL"]}}, (o["metadata"]["name"], c["name"])


def test_the_nats_cluster_routes_to_every_member(objects):
    sts = one(objects, "StatefulSet", "nats")
    conf = one(objects, "ConfigMap", "nats-config")["data"]["nats.conf"]
    routes = re.findall(r"nats://([\w.-]+):6222", conf)
    assert sts["spec"]["replicas"] == 3
    assert routes == [f"nats-{i}.{sts['spec']['serviceName']}" for i in range(3)]
    headless = one(objects, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert "include ./auth.conf" in conf
    anti = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"


def test_nats_server_accepts_the_cluster_config(objects, tmp_path):
    from moemesh.tools.launch.nats_server import NatsServerNotFound, find_nats_server

    try:
        exe = find_nats_server()
    except NatsServerNotFound as e:
        pytest.skip(str(e))
    for key, text in one(objects, "ConfigMap", "nats-config")["data"].items():
        (tmp_path / key).write_text(text)
    secret = one(objects, "Secret", "moemesh-nats-passwords")["data"]
    env = {k: base64.b64decode(v).decode() for k, v in secret.items()}
    env["POD_NAME"] = "nats-0"
    r = subprocess.run([exe, "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    del env["OPS_NATS_PASSWORD"]  # a missing password is an error, not an open account
    r = subprocess.run([exe, "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode != 0 and "OPS_NATS_PASSWORD" in r.stdout + r.stderr


def test_in_cluster_prometheus_names_jobs_as_the_alerts_do(objects):
    prom = yaml.safe_load((K8S / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["alerts.yml"]
    (job,) = prom["scrape_configs"]
    relabel = {r.get("target_label"): r for r in job["relabel_configs"]}
    assert relabel["job"]["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    components = {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for w in workloads(objects)}
    alerts = (REPO / "compose" / "prometheus" / "alerts.yml").read_text()
    used = {j for m in re.findall(r'job=~?"([^"]+)"', alerts) for j in m.split("|")}
    assert used <= components
    for w in workloads(objects):
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9100"
