"""Disconnects, malformed control messages, tracing across services."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import nats
import pytest

from moemesh.shared.protocol.messages import ErrorReply
from moemesh.shared.protocol.wire import decode
from tests.mesh.conftest import worker_stats


def _wait_free(mesh, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pre = asyncio.run(worker_stats(mesh.nats_url, mesh.prefill_id))
        dec = asyncio.run(worker_stats(mesh.nats_url, mesh.decode_id))
        if (pre.load.num_free_blocks == pre.load.num_blocks and dec.load.num_free_blocks == dec.load.num_blocks
                and pre.num_held == 0 and dec.num_transfers == 0 and pre.staging_bytes_used == 0
                and dec.staging_bytes_used == 0):
            return
        assert time.monotonic() < deadline, (pre, dec)
        time.sleep(0.2)


def test_client_disconnect_mid_stream_frees_kv_on_both_workers(mesh):
    _wait_free(mesh)
    body = {"model": "tiny", "prompt": "a long story " * 5, "max_tokens": 3900, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", mesh.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            deadline = time.monotonic() + 10
            # The first token comes from the prefill worker; wait until decode has taken over.
            while asyncio.run(worker_stats(mesh.nats_url, mesh.decode_id)).load.num_running != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    _wait_free(mesh)
    assert httpx.get(mesh.url + "/health").json()["inflight"] == 0
    deadline = time.monotonic() + 10
    while True:  # and it was stopped by the disconnect, not by running to the end
        spans = [json.loads(l) for l in mesh.trace_file.read_text().splitlines() if l.strip()]
        dec_span = [s for s in spans if s["name"] == "decode" and s["attributes"].get("request.id") == rid]
        if dec_span or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    events = [e["name"] for e in dec_span[0]["events"]]
    assert events[-1] == "aborted" and set(events[:-1]) <= {"step"}


@pytest.mark.parametrize("subject_of", [
    lambda m: f"{m.prefix}.prefill.jobs",
    lambda m: f"{m.prefix}.prefill.{m.prefill_id}.kv.pull",
    lambda m: f"{m.prefix}.prefill.{m.prefill_id}.kv.release",
    lambda m: f"{m.prefix}.decode.{m.decode_id}.kv_ready",
    lambda m: f"{m.prefix}.worker.{m.decode_id}.stats",
    lambda m: f"{m.prefix}.gateway.{m.gateway_id}.tokens",
])
@pytest.mark.parametrize("payload", [b"\xc1garbage", b"\x91\x01", b"", b"\x81\xa9sent_at\xa3bad"])
def test_malformed_nats_messages_get_an_error_and_service_keeps_serving(mesh, subject_of, payload):
    async def go():
        nc = await nats.connect(mesh.nats_url)
        try:
            msg = await nc.request(subject_of(mesh), payload, timeout=5)
            return decode(msg.data, ErrorReply)
        finally:
            await nc.close()

    err = asyncio.run(go())
    assert err.code == "bad_request" and err.error
    r = httpx.post(mesh.url + "/v1/completions", json={"model": "tiny", "prompt": "still fine", "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_one_request_is_one_trace_across_all_services(mesh):
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    client_span = "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{client_trace}-{client_span}-01"}
    r = httpx.post(mesh.url + "/v1/chat/completions", headers=headers, timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    deadline = time.monotonic() + 10
    while True:
        spans = [json.loads(l) for l in mesh.trace_file.read_text().splitlines() if l.strip()]
        mine = [s for s in spans if s["trace_id"] == client_trace]
        services = {s["resource"]["service.name"] for s in mine}
        names = {s["name"] for s in mine}
        if {"decode", "kv.transfer", "kv.send", "stream"} <= names or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert services == {"moemesh-gateway", "moemesh-prefill", "moemesh-decode"}, names
    by_id = {s["span_id"]: s for s in mine}
    roots = [s for s in mine if s["parent_span_id"] == client_span]
    assert [s["name"] for s in roots] == ["POST /v1/chat/completions"]
    for s in mine:
        assert s["parent_span_id"] == client_span or s["parent_span_id"] in by_id, s["name"]

    def parent(name):
        return by_id[next(s for s in mine if s["name"] == name)["parent_span_id"]]["name"]

    assert parent("prefill") == "POST /v1/chat/completions"
    assert parent("decode") == "prefill"
    assert parent("kv.transfer") == "decode"
    assert parent("kv.send") == "kv.transfer"
    assert parent("stream") == "POST /v1/chat/completions"
    assert parent("queue.wait") == "prefill" and parent("prefill.batch") == "prefill"
    dec = next(s for s in mine if s["name"] == "decode")
    assert [e["name"] for e in dec["events"]].count("step") == dec["attributes"]["decode.steps"]


def test_a_pull_naming_an_unknown_address_is_refused_not_fatal(mesh):
    """UCX aborts a process given a malformed worker address; the prefill worker must
    never hand one to it, and must keep serving."""
    from moemesh.shared.protocol.messages import KVPull, KVPullItem, KVPullReply
    from moemesh.shared.protocol.wire import encode

    async def go():
        nc = await nats.connect(mesh.nats_url)
        try:
            msg = await nc.request(f"{mesh.prefix}.prefill.{mesh.prefill_id}.kv.pull",
                                   encode(KVPull([KVPullItem("r-x", 1, 64)], b"\x00garbage-address", 5)), timeout=10)
            return decode(msg.data, KVPullReply)
        finally:
            await nc.close()

    reply = asyncio.run(go())
    assert not reply.ok and "no live decode worker" in reply.error
    r = httpx.post(mesh.url + "/v1/completions", json={"model": "tiny", "prompt": "alive?", "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 200
