"""What `kubectl apply -k compose/k8s` would apply, as plain objects, for the tests:
the kustomization rendered (without kustomize's name hashes), the secrets an operator
writes, and each pod's environment as Kubernetes resolves it."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import yaml

from moemesh.tools.launch.nats_auth import identities
from moemesh.tools.launch.up import password_env, up_config


def render(root: Path) -> list[dict]:
    """What `kubectl apply -k root` applies, for what kustomization.yaml uses: resources,
    the namespace, ConfigMaps from files and Secrets from env files and files (names
    without kustomize's hash suffix)."""
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    out = [d for r in k["resources"] for d in yaml.safe_load_all((root / r).read_text()) if d]

    def key_and_path(spec: str) -> tuple[str, Path]:
        key, _, path = spec.rpartition("=")
        return key or Path(path).name, root / path

    for g in k.get("configMapGenerator", []):
        data = dict((key, p.read_text()) for key, p in map(key_and_path, g["files"]))
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": g["name"]}, "data": data})
    for g in k.get("secretGenerator", []):
        raw = dict((key, p.read_bytes()) for key, p in map(key_and_path, g.get("files", [])))
        for env in g.get("envs", []):
            for line in (root / env).read_text().splitlines():
                if line.strip() and not line.startswith("#"):
                    key, _, value = line.partition("=")
                    raw[key] = value.encode()
        data = {key: base64.b64encode(v).decode() for key, v in raw.items()}
        out.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": g["name"]},
                    "data": data})
    for d in out:
        if d["kind"] != "Namespace":
            d["metadata"]["namespace"] = k["namespace"]
    return out


def write_secrets(root: Path) -> dict[str, str]:
    """secrets/ as docs/deployment.md has the operator write it: one password per user of
    the deployment's NATS table, and an API key."""
    users = identities(up_config(str(root / "moemesh.toml")))
    passwords = {password_env(u.worker_id): f"pw-{u.worker_id}" for u in users}
    (root / "secrets").mkdir(exist_ok=True)
    (root / "secrets" / "nats-passwords.env").write_text("".join(f"{k}={v}\n" for k, v in passwords.items()))
    (root / "secrets" / "api_keys").write_text("sk-test\n")
    return passwords


def one(objects, kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def workloads(objects) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")
            and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name") == "moemesh"]


def container(w: dict) -> dict:
    (c,) = w["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def deployment_file(objects) -> str:
    return one(objects, "ConfigMap", "moemesh-config")["data"]["moemesh.toml"]


def secret_keys(objects, name: str) -> set[str]:
    return set(one(objects, "Secret", name)["data"])


def ranks(w: dict) -> range:
    return range(w["spec"]["replicas"]) if w["kind"] == "StatefulSet" else range(1)


def pod_env(w: dict, rank: int) -> dict[str, str]:
    """The literal environment of one pod (a StatefulSet's pod `rank`) as Kubernetes
    makes it: fieldRefs to the pod's name and labels resolved, then $(VAR) references,
    in order (a reference to a later or unknown variable stays as written)."""
    labels = dict(w["spec"]["template"]["metadata"]["labels"])
    name = w["metadata"]["name"]
    if w["kind"] == "StatefulSet":
        labels["apps.kubernetes.io/pod-index"] = str(rank)
        name = f"{name}-{rank}"
    fields = {"metadata.name": name, **{f"metadata.labels['{k}']": v for k, v in labels.items()}}
    out: dict[str, str] = {}
    for var, e in env_of(container(w)).items():
        if "value" in e:
            out[var] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            out[var] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def worker_ids(w: dict) -> list[str]:
    return [pod_env(w, r)["MOEMESH_WORKER_ID"] for r in ranks(w)]


# ---- schema -------------------------------------------------------------------------------
