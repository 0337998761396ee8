"""compose/systemd: one templated unit per service, checked field by field, and by
`systemd-analyze verify` where the host has it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "compose" / "systemd"
SERVICES = ["gateway", "prefill", "decode", "balancer", "kv_store"]
SANDBOX = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
           "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectControlGroups": "yes",
           "RestrictSUIDSGID": "yes", "CapabilityBoundingSet": ""}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections of key -> every value (systemd allows repeated keys, e.g. EnvironmentFile)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        assert section is not None and "=" in line, f"stray line {raw!r}"
        k, v = line.split("=", 1)
        section.setdefault(k.strip(), []).append(v.strip())
    return out


@pytest.mark.parametrize("service", SERVICES)
def test_unit_fields(service):
    unit = parse_unit((UNITS / f"moemesh-{service}@.service").read_text())
    u, s, i = unit["Unit"], unit["Service"], unit["Install"]
    assert "nats-server.service" in u["After"][0].split() and "nats-server.service" in u["Wants"][0].split()
    assert u["PartOf"] == ["moemesh.target"] and i["WantedBy"] == ["moemesh.target"]
    assert s["User"] == ["moemesh"]
    assert s["Restart"] == ["on-failure"]
    assert s["KillSignal"] == ["SIGTERM"]
    assert int(s["TimeoutStopSec"][0].rstrip("s")) > 30  # beyond the default drain_timeout_s
    assert f"/etc/moemesh/{service}-%i.env" in s["EnvironmentFile"]
    (exec_start,) = s["ExecStart"]
    assert exec_start.startswith("/opt/moemesh/.venv/bin/python -m moemesh.services." + service)
    assert "--config /etc/moemesh/moemesh.toml" in exec_start
    for key, value in SANDBOX.items():
        assert s.get(key) == [value], key
    assert any("/var/cache/moemesh" in p for p in s["ReadWritePaths"][0].split())
    assert any("/var/log/moemesh" in p for p in s["ReadWritePaths"][0].split())
    # Workers keep /dev (GPUs, RDMA NICs) and may pin memory for UCX; the rest get a private /dev.
    worker = service in ("prefill", "decode")
    assert ("PrivateDevices" in s) != worker
    assert (s.get("LimitMEMLOCK") == ["infinity"]) == worker


def test_example_env_uses_settings_the_loader_knows():
    from moemesh.services.decode.config import DecodeConfig
    from moemesh.shared.config.loader import load

    env = {}
    for line in (UNITS / "example.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, v = line.split("=", 1)
            env[k] = v
    moemesh = {k: v for k, v in env.items() if k.startswith("MOEMESH_")}
    # It is rank 3 of the rack's DEP32 decode instance: the file holds what the ranks share.
    cfg = load(DecodeConfig, "decode", UNITS.parent / "rack" / "moemesh.toml", environ=moemesh)
    assert (cfg.worker_id, cfg.dp_rank, cfg.dp_size, cfg.nats_user, cfg.ucx_net_devices) == \
        (env["MOEMESH_WORKER_ID"], 3, 32, "decode-i0-r3", "mlx5_3:1")
    assert cfg.metrics_port == 9103 and cfg.nats_password == env["MOEMESH_NATS_PASSWORD"]


def test_example_env_connects_as_its_own_user_in_the_racks_nats_table():
    """The rank's NATS user is its worker id, one of the users `moemesh nats-auth` writes
    for the rack file, and its password is the one the servers read for that user."""
    from moemesh.tools.launch.nats_auth import identities, permissions
    from moemesh.tools.launch.up import password_env, up_config

    text = (UNITS / "example.env").read_text()
    env = dict(line.split("=", 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))
    users = {w.worker_id: w for w in identities(up_config(str(UNITS.parent / "rack" / "moemesh.toml")))}
    me = env["MOEMESH_NATS_USER"]
    assert me == env["MOEMESH_WORKER_ID"] and me in users
    assert f"mm.heartbeat.decode.{me}" in permissions(users[me]).publish
    assert f"${password_env(me)}" in text  # the comment names the servers' variable for it


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("service", SERVICES)
def test_systemd_analyze_verify(tmp_path, service):
    # verify checks that ExecStart= is executable, so the copy points at this interpreter;
    # everything else is the shipped unit, instantiated as @t.
    for f in UNITS.glob("moemesh*"):
        text = f.read_text().replace("/opt/moemesh/.venv/bin/python", sys.executable)
        (tmp_path / f.name).write_text(text)
    inst = tmp_path / f"moemesh-{service}@t.service"
    inst.symlink_to(tmp_path / f"moemesh-{service}@.service")
    r = subprocess.run(["systemd-analyze", "verify", str(inst), str(tmp_path / "moemesh.target")],
                       capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and bad values; its warnings name the file and line.
    ours = [ln for ln in (r.stdout + r.stderr).splitlines() if "moemesh" in ln]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr
