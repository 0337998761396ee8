"""Per-worker NATS users from `moemesh nats-auth`, against a real nats-server: a worker
publishes only as itself, a user reads only its own reply inbox, and requests between
services are still answered."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import pytest

from moemesh.shared.config.common import ServiceConfig
from moemesh.shared.service.nats_io import connect, disconnect
from moemesh.tools.cli.main import main as cli_main
from moemesh.tools.launch.nats_auth import identities, permissions, render_auth_conf
from moemesh.tools.launch.nats_server import find_nats_server
from moemesh.tools.launch.procs import ProcessGroup, free_port, wait_for_port
from moemesh.tools.launch.up import WorkerName, password_env, up_config

REPO = Path(__file__).resolve().parents[2]
POOLS = "[pools]\nprefill = 1\ndecode = 2\nkv_store = true\nbalancer = true\n"


def test_the_shipped_compose_table_is_the_generated_one(capsys):
    """compose/nats/auth.conf is what `moemesh nats-auth` writes for compose/moemesh.toml."""
    import os

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert cli_main(["nats-auth", "--config", "compose/moemesh.toml"]) == 0
    finally:
        os.chdir(cwd)
    assert capsys.readouterr().out == (REPO / "compose" / "nats" / "auth.conf").read_text()


def test_permissions_name_only_the_workers_own_subjects():
    perm = permissions(WorkerName("decode", "decode-1"), "mm")
    own = [s for s in perm.publish if "heartbeat" in s or "tokens" in s or ".events" in s]
    assert own == ["mm.heartbeat.decode.decode-1", "mm.gateway.*.tokens.decode-1", "mm.kv.decode-1.events"]
    assert "_INBOX.decode-1.>" in perm.subscribe and not any(s in ("_INBOX.>", ">") for s in perm.subscribe)
    rank = permissions(WorkerName("prefill", "prefill-i0-r1", "prefill-i0", 1), "x.y")
    assert "x.y.eplb.prefill-i0.commit" in rank.subscribe and "x.y.heartbeat.prefill.prefill-i0-r1" in rank.publish
    with pytest.raises(ValueError, match="unique"):
        render_auth_conf([WorkerName("decode", "d"), WorkerName("prefill", "d")])


def test_each_of_several_gateways_has_its_own_user(tmp_path):
    (tmp_path / "d.toml").write_text("[pools]\ngateways = 2\n")
    gateways = [w for w in identities(up_config(str(tmp_path / "d.toml"))) if w.role == "gateway"]
    assert [w.worker_id for w in gateways] == ["gateway-0", "gateway-1"]
    second = permissions(gateways[1], "mm")
    assert "mm.gateway.gateway-1.tokens.*" in second.subscribe and "_INBOX.gateway-1.>" in second.subscribe
    assert not any("gateway-0" in s for s in (*second.subscribe, *second.publish))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nats-auth")
    deployment = tmp / "moemesh.toml"
    deployment.write_text(POOLS)
    users = identities(up_config(str(deployment)))
    (tmp / "auth.conf").write_text(render_auth_conf(users))
    port = free_port()
    (tmp / "nats.conf").write_text(f"listen: 127.0.0.1:{port}\ninclude ./auth.conf\n")
    passwords = {u.worker_id: secrets.token_hex(8) for u in users}
    group = ProcessGroup(tmp)
    child = group.start("nats", [find_nats_server(), "-c", str(tmp / "nats.conf")],
                        {password_env(u): pw for u, pw in passwords.items()})
    try:
        wait_for_port("127.0.0.1", port, 15, child)
        yield f"nats://127.0.0.1:{port}", passwords
    finally:
        group.stop()


def _cfg(server, user: str, **kw) -> ServiceConfig:
    url, passwords = server
    return ServiceConfig(nats_url=url, nats_user=user, nats_password=passwords[user], **kw)


async def _violations(server, user: str, op: str, subject: str) -> list[str]:
    """Publishes to or subscribes on subject as user; returns the server's permission errors."""
    import nats

    url, passwords = server
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e).lower())

    nc = await nats.connect(url, user=user, password=passwords[user], error_cb=on_error, allow_reconnect=False,
                            inbox_prefix=f"_INBOX.{user}")
    try:
        await (nc.publish(subject, b"probe") if op == "pub" else nc.subscribe(subject))
        await nc.flush(timeout=5)  # the -ERR comes ahead of the PONG
        await asyncio.sleep(0.05)  # room for the error callback
    finally:
        await nc.close()
    return [e for e in errors if "permissions violation" in e]


@pytest.mark.parametrize("user, op, subject, allowed", [
    ("decode-0", "pub", "mm.heartbeat.decode.decode-0", True),
    ("decode-0", "pub", "mm.heartbeat.decode.decode-1", False),  # another decode worker
    ("decode-0", "pub", "mm.heartbeat.decode.fake", False),  # a made-up one
    ("decode-0", "pub", "mm.heartbeat.prefill.prefill-0", False),
    ("decode-0", "pub", "mm.gateway.gateway.tokens.decode-0", True),
    ("decode-0", "pub", "mm.gateway.gateway.tokens.decode-1", False),
    ("decode-0", "pub", "mm.kv.decode-0.events", True),
    ("decode-0", "pub", "mm.kv.decode-1.events", False),
    ("decode-0", "sub", "mm.decode.decode-1.kv_ready", False),  # nor take another's hand-offs
    ("decode-0", "sub", "mm.worker.decode-1.resend", False),
    ("gateway", "pub", "mm.worker.decode-0.resend", True),
    ("prefill-0", "pub", "mm.heartbeat.prefill.prefill-0", True),
    ("kv_store", "pub", "mm.kv.prefill-0.events", False),
    ("gateway", "pub", "mm.heartbeat.decode.decode-0", False),
    ("gateway", "sub", "mm.gateway.gateway.tokens.*", True),
    ("gateway", "sub", "mm.prefill.jobs", False),
    ("prefill-0", "pub", "mm.eplb.prefill-0.commit", False),  # only the balancer moves experts
    ("balancer", "pub", "mm.eplb.prefill-0.commit", True),
    ("ops", "sub", "_INBOX.ops.>", True),
    ("ops", "sub", "_INBOX.>", False),  # nobody reads every reply
    ("ops", "sub", "_INBOX.gateway.>", False),
    ("gateway", "sub", "_INBOX.decode-0.>", False),
    ("decode-1", "sub", "_INBOX.decode-0.abc.*", False),
])
def test_each_user_may_only_use_its_own_subjects(server, user, op, subject, allowed):
    errors = asyncio.run(_violations(server, user, op, subject))
    assert (errors == []) == allowed, errors


def test_replies_reach_the_requester_on_its_own_inbox(server):
    async def go():
        worker = await connect(_cfg(server, "decode-0", worker_id="decode-0"), "test-decode")
        ops = await connect(_cfg(server, "ops"), "test-ops")
        gateway = await connect(_cfg(server, "gateway", worker_id="gateway"), "test-gateway")
        prefill = await connect(_cfg(server, "prefill-0", worker_id="prefill-0"), "test-prefill")
        try:
            async def answer(msg) -> None:
                await msg.respond(b"re:" + msg.data)

            await worker.subscribe("mm.worker.decode-0.stats", cb=answer)
            await prefill.subscribe("mm.prefill.prefill-0.jobs", cb=answer)
            await worker.flush()
            await prefill.flush()
            stats = await ops.request("mm.worker.decode-0.stats", b"s", timeout=5)
            job = await gateway.request("mm.prefill.prefill-0.jobs", b"j", timeout=5)
            return stats.subject, stats.data, job.subject, job.data
        finally:
            for nc in (worker, ops, gateway, prefill):
                await disconnect(nc)

    stats_inbox, stats, job_inbox, job = asyncio.run(go())
    assert (stats, job) == (b"re:s", b"re:j")
    assert stats_inbox.startswith("_INBOX.ops.") and job_inbox.startswith("_INBOX.gateway.")


def test_the_cli_writes_the_table_and_names_the_password_variables(tmp_path, capsys):
    (tmp_path / "d.toml").write_text('[common]\nsubject_prefix = "prod"\n' + POOLS)
    out = tmp_path / "auth.conf"
    assert cli_main(["nats-auth", "--config", str(tmp_path / "d.toml"), "-o", str(out)]) == 0
    text = out.read_text()
    assert '"prod.heartbeat.decode.decode-1"' in text and "$DECODE_1_NATS_PASSWORD" in text
    assert "DECODE_1_NATS_PASSWORD" in capsys.readouterr().err
    users = [json.loads(line.split("user: ")[1].split(",")[0]) for line in text.splitlines() if "{user:" in line]
    assert users == ["kv_store", "prefill-0", "decode-0", "decode-1", "balancer", "gateway", "ops"]
