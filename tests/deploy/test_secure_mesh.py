"""A mesh deployed with its security defaults on: one NATS user per worker with the
permissions `moemesh nats-auth` writes for the deployment, API keys at the gateway, /metrics on its own address,
and `moemesh up --config` reading one deployment file. Then: what each NATS user may do,
a request end to end, the API key enforced, and no prompt or key in any log or span."""

from __future__ import annotations

import asyncio
import json
import secrets
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from moemesh.tools.launch.nats_auth import write_auth_conf
from moemesh.tools.launch.nats_server import find_nats_server
from moemesh.tools.launch.procs import ProcessGroup, free_port, wait_for_port
from moemesh.tools.launch.up import Mesh, password_env, up_config

# Distinctive enough that finding them anywhere can only mean they leaked.
PROMPT = "Quokka-Zephyr-" + secrets.token_hex(6) + " plans a secret itinerary"
KEY = "sk-moemesh-right-" + secrets.token_hex(10)
WRONG_KEY = "sk-moemesh-wrong-" + secrets.token_hex(10)


@dataclass
class Secure:
    mesh: Mesh
    nats: ProcessGroup
    nats_url: str
    metrics_url: str
    passwords: dict[str, str]
    log_dir: Path
    trace_file: Path


@pytest.fixture(scope="module")
def secure(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secure")
    log_dir = tmp / "logs"
    port = free_port()
    nats_url = f"nats://127.0.0.1:{port}"
    (tmp / "api_keys").write_text(f"# test keys\nsk-another-{secrets.token_hex(4)}\n{KEY}\n")
    metrics_port = free_port()
    deployment = tmp / "moemesh.toml"
    deployment.write_text(f"""
[common]
nats_url = "{nats_url}"
served_model_name = "tiny"
log_level = "DEBUG"

[pools]
prefill = 1
decode = 1
balancer = true
kv_store = true

[gateway]
api_keys_file = "{tmp / 'api_keys'}"
metrics_port = {metrics_port}

[prefill]
num_kv_blocks = 256
staging_mb = 16

[decode]
num_kv_blocks = 256
staging_mb = 16

[balancer]

[kv_store]
capacity_mb = 64
staging_mb = 16
""")
    # The user table written for this deployment, included from a server config that only
    # says where it listens; every password reaches the server and `moemesh up` by its variable.
    users = [u.worker_id for u in write_auth_conf(up_config(str(deployment)), tmp / "auth.conf")]
    passwords = {u: secrets.token_hex(12) for u in users}
    password_vars = {password_env(u): pw for u, pw in passwords.items()}
    store = json.dumps(str(tmp / "js"))
    (tmp / "nats.conf").write_text(f"listen: 127.0.0.1:{port}\njetstream {{ store_dir: {store} }}\n"
                                   "include ./auth.conf\n")
    nats = ProcessGroup(log_dir)
    child = nats.start("nats", [find_nats_server(), "-c", str(tmp / "nats.conf")], password_vars)
    trace = tmp / "trace.jsonl"
    try:
        wait_for_port("127.0.0.1", port, 15, child)
        mesh = Mesh(up_config(str(deployment), model=tiny_model, port=0, log_dir=str(log_dir),
                              trace_file=str(trace), ready_timeout_s=120, extra_env=password_vars))
        mesh.start()
    except BaseException:
        nats.stop()
        raise
    yield Secure(mesh, nats, nats_url, f"http://127.0.0.1:{metrics_port}", passwords, log_dir, trace)
    mesh.stop()
    nats.stop()


async def _try(nats_url: str, user: str, password: str, op: str, subject: str) -> list[str]:
    """Publishes to or subscribes on subject as user; returns the errors the server sent."""
    import nats

    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(nats_url, user=user, password=password, error_cb=on_error, allow_reconnect=False,
                            inbox_prefix=f"_INBOX.{user}")
    try:
        if op == "pub":
            await nc.publish(subject, b"probe")
        else:
            await nc.subscribe(subject)
        await nc.flush(timeout=5)
        for _ in range(20):  # the -ERR comes ahead of the PONG; this only covers slow callbacks
            if errors:
                break
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return errors


@pytest.mark.parametrize("user, op, subject, allowed", [
    ("prefill-0", "pub", "mm.eplb.x.commit", False),  # only the balancer moves experts
    ("prefill-0", "pub", "mm.eplb.prefill-0.plan", False),
    ("decode-0", "pub", "mm.eplb.decode-0.abort", False),
    ("gateway", "pub", "mm.heartbeat.decode.fake", False),  # the gateway cannot pose as a worker
    ("decode-0", "pub", "mm.heartbeat.prefill.fake", False),  # nor a worker as another role
    ("decode-0", "pub", "mm.heartbeat.decode.decode-1", False),  # nor as another worker of its own
    ("gateway", "sub", "mm.prefill.jobs", False),  # nor steal prompts meant for prefill
    ("balancer", "pub", "mm.prefill.jobs", False),
    ("ops", "pub", "mm.eplb.x.commit", False),
    ("ops", "sub", "_INBOX.>", False),  # nor read others' replies
    ("balancer", "pub", "mm.eplb.x.commit", True),
    ("prefill-0", "pub", "mm.eplb.prefill-0.load", True),
    ("prefill-0", "pub", "mm.decode.x.kv_ready", True),
    ("decode-0", "sub", "mm.eplb.decode-0.commit", True),
    ("ops", "pub", "mm.eplb.x.rebalance", True),
])
def test_nats_permissions(secure, user, op, subject, allowed):
    errors = asyncio.run(_try(secure.nats_url, user, secure.passwords[user], op, subject))
    if allowed:
        assert errors == []
    else:
        kind = "publish" if op == "pub" else "subscription"
        assert any(f'permissions violation for {kind} to "{subject}"'.lower() in e.lower() for e in errors), errors


def test_commits_reach_ranks_from_the_balancer_only(secure):
    async def go():
        import nats

        pw = secure.passwords
        got = []

        async def on_commit(msg) -> None:
            got.append(msg.data)

        rank = await nats.connect(secure.nats_url, user="decode-0", password=pw["decode-0"])
        try:
            await rank.subscribe("mm.eplb.decode-0.commit", cb=on_commit)
            await rank.flush()
            for user, data in (("prefill-0", b"forged"), ("balancer", b"real")):
                nc = await nats.connect(secure.nats_url, user=user, password=pw[user], error_cb=_ignore)
                try:
                    await nc.publish("mm.eplb.decode-0.commit", data)
                    await nc.flush()
                finally:
                    await nc.close()
            for _ in range(40):
                if got:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # room for a forged one that got through late
        finally:
            await rank.close()
        return got

    assert asyncio.run(go()) == [b"real"]


async def _ignore(e: Exception) -> None:
    pass


@pytest.mark.parametrize("password", [None, "not-the-password"])
def test_connections_without_the_right_password_are_refused(secure, password):
    # Spoken by hand: nats-py leaves its socket open when a connect is refused.
    import socket

    host, port = secure.nats_url.removeprefix("nats://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        f = s.makefile("rb")
        assert f.readline().startswith(b"INFO ")
        creds = {} if password is None else {"user": "prefill-0", "pass": password}
        s.sendall(b"CONNECT " + json.dumps({"verbose": False, "pedantic": False, **creds}).encode()
                  + b"\r\nPING\r\n")
        assert f.readline().strip() == b"-ERR 'Authorization Violation'"
        f.close()
    with socket.create_connection((host, int(port)), timeout=5) as s:  # the control: the right password
        f = s.makefile("rb")
        f.readline()
        creds = {"user": "prefill-0", "pass": secure.passwords["prefill-0"]}
        s.sendall(b"CONNECT " + json.dumps({"verbose": False, "pedantic": False, **creds}).encode()
                  + b"\r\nPING\r\n")
        assert f.readline().strip() == b"PONG"
        f.close()


def _chat(url: str, key: str | None, stream: bool) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "stream": stream,
            "ignore_eos": True}  # six tokens whatever the random model samples
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_a_request_is_served_end_to_end_with_the_key(secure):
    r = _chat(secure.mesh.url, KEY, stream=False)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    r = _chat(secure.mesh.url, KEY, stream=True)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_the_api_key_is_enforced(secure):
    url = secure.mesh.url
    for key in (None, WRONG_KEY):
        r = _chat(url, key, stream=False)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"})
    assert r.status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    assert httpx.get(url + "/health/ready").status_code == 200


def test_metrics_are_served_on_their_own_address_only(secure):
    assert httpx.get(secure.mesh.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    with urllib.request.urlopen(secure.metrics_url + "/metrics", timeout=5) as r:
        assert b"requests_total" in r.read()
    with urllib.request.urlopen(secure.metrics_url + "/health", timeout=5) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_logs_and_traces_never_hold_prompts_keys_or_passwords(secure):
    r = _chat(secure.mesh.url, KEY, stream=True)  # one more, whatever order the tests ran in
    assert r.status_code == 200
    assert _chat(secure.mesh.url, WRONG_KEY, stream=False).status_code == 401
    secure.mesh.stop()  # shutdown and drain lines are logged too
    logs = {p.name: p.read_text(errors="replace") for p in secure.log_dir.glob("*.log")}
    services = ["gateway.log", "prefill-0.log", "decode-0.log", "balancer.log", "kv_store.log"]
    assert {*services, "nats.log"} <= set(logs)
    assert "listening" in logs["gateway.log"] and "ready" in logs["decode-0.log"]  # the right files, written
    spans = secure.trace_file.read_text()
    assert '"prompt.tokens"' in spans  # the request was traced, by token count
    needles = {"prompt": PROMPT, "prompt fragment": PROMPT.split()[0], "api key": KEY, "wrong key": WRONG_KEY,
               **{f"{u} password": pw for u, pw in secure.passwords.items()}}
    for where, text in {**logs, "trace file": spans}.items():
        for what, needle in needles.items():
            assert needle not in text, f"{what} found in {where}"
    for name in services:
        assert "permissions violation" not in logs[name].lower(), f"{name}: auth.conf denies a subject it uses"
