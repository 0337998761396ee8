"""The services' request logic in one process: a real nats-server, the loopback KV
transport in place of UCX, and prefill, decode, the gateway, the KV store and the
balancer as async context managers on one event loop. What only separate processes
can show (UCX, signals, `moemesh up`, DEP over gloo) stays in tests/mesh."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest

from moemesh.services.balancer.config import BalancerConfig
from moemesh.services.balancer.service import BalancerService
from moemesh.services.decode.config import DecodeConfig
from moemesh.services.decode.service import DecodeService
from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.service import GatewayService
from moemesh.services.kv_store.config import KVStoreConfig
from moemesh.services.kv_store.service import KVStoreService
from moemesh.services.prefill.config import PrefillConfig
from moemesh.services.prefill.service import PrefillService
from moemesh.shared.protocol.messages import (
    Abort, Ack, ErrorReply, Heartbeat, KVFetch, KVFetchReply, KVPut, KVPutReply, KVReady, KVReadyItem, KVReadyReply,
    PrefillJob, RebalanceReply, RebalanceRequest, SamplingParams, WireSampling, WorkerLoad, decode,
)
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.nats_io import publish, request
from moemesh.shared.transport.loopback import LoopbackHub, LoopbackTransport

_prefixes = iter(range(1_000_000))


@dataclass
class Mesh:
    url: str
    nats_url: str
    prefix: str
    prefill: PrefillService
    decode: DecodeService
    gateway: GatewayService
    trace_file: Path


async def _wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        while True:
            h = (await c.get(url + "/health/ready")).json()
            if h["ready"] and h["workers"]["decode"] >= 1 and h["workers"]["prefill"] >= 1:
                return
            assert time.monotonic() < deadline, h
            await asyncio.sleep(0.05)


@asynccontextmanager
async def mesh(nats_url: str, model: str, tmp: Path, engines=None, prefill_only=None, decode_only=None,
               gateway=None, **worker):
    """Prefill, decode and a gateway on this event loop, the KV moving over loopback.
    engines: (prefill engine, decode engine) built already; else from the config.
    prefill_only, decode_only: settings of one role (worker: both roles'); gateway: the
    gateway's."""
    prefix = f"t{next(_prefixes)}"
    hub = LoopbackHub()
    trace = tmp / f"{prefix}-trace.jsonl"
    common = dict(nats_url=nats_url, model=model, subject_prefix=prefix, served_model_name="tiny",
                  heartbeat_interval_s=0.2, staging_mb=16, num_kv_blocks=256, trace_file=str(trace), **worker)
    pre_engine, dec_engine = engines or (None, None)
    async with AsyncExitStack() as stack:
        pre = await stack.enter_async_context(PrefillService(
            PrefillConfig(worker_id="prefill-t", **common, **(prefill_only or {})), pre_engine, lambda: LoopbackTransport(hub)))
        dec = await stack.enter_async_context(DecodeService(
            DecodeConfig(worker_id="decode-t", **common, **(decode_only or {})), dec_engine, lambda: LoopbackTransport(hub)))
        gw = await stack.enter_async_context(GatewayService(GatewayConfig(
            nats_url=nats_url, model=model, subject_prefix=prefix, served_model_name="tiny", port=0,
            worker_id="gw-t", trace_file=str(trace), **(gateway or {}))))
        url = f"http://127.0.0.1:{gw.port}"
        await _wait_ready(url)
        yield Mesh(url, nats_url, prefix, pre, dec, gw, trace)


@asynccontextmanager
async def kv_ready_seen(nats_url: str, prefix: str, decode_id: str = "decode-t"):
    """The hand-off notices (KVReady) prefill workers send `decode_id` while the block runs."""
    nc = await nats.connect(nats_url)
    seen: list[KVReady] = []

    async def spy(msg):
        seen.append(decode(msg.data, KVReady))

    sub = await nc.subscribe(Subjects(prefix).decode_kv_ready(decode_id), cb=spy)
    await nc.flush()
    try:
        yield seen
    finally:
        await sub.unsubscribe()
        await nc.close()


def _all_free(m: Mesh) -> bool:
    p, d = m.prefill.rt, m.decode.rt
    return (p.engine.blocks.num_free_blocks == p.engine.blocks.num_blocks
            and d.engine.blocks.num_free_blocks == d.engine.blocks.num_blocks
            and not m.prefill.jobs and not len(m.prefill.leases) and not m.decode.pulls and not m.decode.active
            and p.staging.bytes_used == 0 and d.staging.bytes_used == 0)


async def _wait_free(m: Mesh, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not _all_free(m):
        assert time.monotonic() < deadline, "KV blocks or staging memory still held"
        await asyncio.sleep(0.02)


def _sse_text(body: str) -> tuple[str, list[str]]:
    text, reasons = "", []
    for line in body.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            text += choice.get("text") or ""
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
    return text, reasons


def test_a_request_streams_through_prefill_kv_handoff_and_decode(nats_url, tiny_model, tiny_engine_factory,
                                                                  offline, tmp_path):
    async def go():
        engines = (tiny_engine_factory(role="prefill", num_kv_blocks=256),
                   tiny_engine_factory(role="decode", num_kv_blocks=256))
        async with mesh(nats_url, tiny_model, tmp_path, engines) as m:
            body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(m.url + "/v1/completions", json=body)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert "x-moemesh-worker" not in r.headers  # internal names stay inside (worker_header: opt-in)
            await _wait_free(m)
            return r.text, m.prefill.rt.metrics.render()[0], m.decode.rt.metrics.render()[0]

    text, pre_metrics, dec_metrics = asyncio.run(go())
    want = offline.generate(["Hello world"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert _sse_text(text) == (want.text, ["length"])
    # The prompt's KV went prefill -> decode over the (loopback) transport, not recomputed.
    assert _metric(pre_metrics, "moemesh_kv_bytes_sent_total") > 0
    assert _metric(dec_metrics, "moemesh_kv_bytes_received_total") == _metric(pre_metrics, "moemesh_kv_bytes_sent_total")
    assert "kv_pull_failures_total{" not in dec_metrics.decode()
    # vLLM-level worker gauges, read at scrape time: nothing runs now, and the counters are there
    for name in ("moemesh_num_requests_running", "moemesh_num_requests_waiting", "moemesh_kv_cache_usage_ratio"):
        assert _metric(dec_metrics, name) == 0
    assert 'moemesh_spec_decode_draft_tokens_total{model_name="tiny"}' in dec_metrics.decode()
    assert _metric(dec_metrics, "moemesh_spec_decode_accepted_tokens_total") <= \
        _metric(dec_metrics, "moemesh_spec_decode_draft_tokens_total")


def test_the_first_decode_step_after_a_handoff_verifies_the_prefill_draft(nats_url, tiny_model, tiny_engine_factory,
                                                                           offline, tmp_path):
    """With MTP on, the prefill worker's draft for the first decode step rides on KVReady,
    so the decode worker runs the offline engine's steps: the same drafts verified and
    accepted (one request: the same batches, whatever the random weights accept)."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = offline.tokenizer.encode("Hello world")
    ref = tiny_engine_factory()
    ref.add_request("r", prompt, params)
    while ref.has_unfinished():
        ref.step()
    assert ref.num_drafted_total > 0

    async def go():
        engines = (tiny_engine_factory(role="prefill"), tiny_engine_factory(role="decode"))
        async with mesh(nats_url, tiny_model, tmp_path, engines) as m:
            async with kv_ready_seen(nats_url, m.prefix) as seen:
                body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "temperature": 0,
                        "ignore_eos": True}
                async with httpx.AsyncClient(timeout=30) as c:
                    r = await c.post(m.url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                await _wait_free(m)
            dec = m.decode.rt.engine
            return r.json(), seen, dec.num_drafted_total, dec.num_accepted_total

    got, seen, drafted, accepted = asyncio.run(go())
    want = offline.generate(["Hello world"], params)[0]
    assert got["choices"][0]["text"] == want.text
    assert [len(i.draft_ids) for r in seen for i in r.items] == [1]
    assert (drafted, accepted) == (ref.num_drafted_total, ref.num_accepted_total)


def _metric(render: bytes, name: str) -> float:
    for line in render.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_client_disconnect_mid_stream_frees_kv_on_both_workers(nats_url, tiny_model, tmp_path):
    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=2.0) as m:
            body = {"model": "tiny", "prompt": "a long story " * 5, "max_tokens": 3900, "stream": True,
                    "temperature": 0, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=30) as c:
                async with c.stream("POST", m.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    rid = r.headers["x-request-id"]
                    lines = r.aiter_lines()
                    while not (await anext(lines)).startswith("data: {"):
                        pass
                    # The first token comes from the prefill worker; wait until decode has taken over.
                    deadline = time.monotonic() + 10
                    while rid not in m.decode.active or m.decode.pulls:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.01)
                    assert not _all_free(m)
            await _wait_free(m)
            assert m.gateway.state.inflight == 0
            return rid, m.trace_file

    rid, trace = asyncio.run(go())
    # Stopped by the disconnect, not by running to the end (the services flushed their spans on close).
    spans = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    dec = [s for s in spans if s["name"] == "decode" and s["attributes"].get("request.id") == rid]
    events = [e["name"] for e in dec[0]["events"]]
    assert events[-1] == "aborted" and set(events[:-1]) <= {"step"}


@pytest.mark.parametrize("subject_of", [
    lambda m: f"{m.prefix}.prefill.jobs",
    lambda m: f"{m.prefix}.prefill.prefill-t.kv.release",
    lambda m: f"{m.prefix}.decode.decode-t.kv_ready",
    lambda m: f"{m.prefix}.worker.decode-t.stats",
    lambda m: f"{m.prefix}.gateway.gw-t.tokens.decode-t",
], ids=["jobs", "kv_release", "kv_ready", "stats", "tokens"])
def test_malformed_nats_messages_get_an_error_and_services_keep_serving(nats_url, tiny_model, tmp_path, subject_of):
    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=1.0) as m:
            nc = await nats.connect(m.nats_url)
            try:
                for payload in (b"\xc1garbage", b"\x91\x01", b"", b"\x81\xa9sent_at\xa3bad"):
                    err = decode((await nc.request(subject_of(m), payload, timeout=5)).data, ErrorReply)
                    assert err.code == "bad_request" and err.error, payload
            finally:
                await nc.close()
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(m.url + "/v1/completions", json={"model": "tiny", "prompt": "still fine",
                                                                  "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1

    asyncio.run(go())


def test_a_send_to_an_unknown_address_is_refused_not_fatal():
    """UCX aborts a process given a malformed worker address; the prefill worker must
    never hand one to its transport: a hand-off reply naming an address no live decode
    worker has is refused before anything is gathered or sent."""
    from moemesh.services.prefill.service import KVSender
    from moemesh.shared.protocol.registry import KVPeers
    from moemesh.shared.transport.base import TransferError

    class Transport:
        sent = 0

        async def send(self, *a):
            self.sent += 1

    t = Transport()
    sender = KVSender(None, None, None, t, KVPeers("decode"), 1.0, heartbeat_interval_s=0.01)
    with pytest.raises(TransferError, match="no live decode worker"):
        asyncio.run(sender.send(b"\x00garbage-address", 5, []))
    assert t.sent == 0


def test_a_send_that_fails_fails_its_receive_at_once(nats_url, tiny_model, tmp_path):
    """A prefill worker that cannot send a hand-off's bytes says so (KVSendFailed): the
    decode worker recomputes the prompt at once, long before its transfer timeout (600 s
    here, against the client's 60)."""

    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=1.0,
                        prefill_only={"debug_kv_fault": "error"},
                        decode_only={"transfer_timeout_s": 600.0, "on_transfer_failure": "recompute"}) as m:
            async with httpx.AsyncClient(timeout=60) as c:
                r = await c.post(m.url + "/v1/completions", json={"model": "tiny", "prompt": "resent", "max_tokens": 4,
                                                                  "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            assert not m.decode.pulls and m.prefill.rt.staging.bytes_used == m.decode.rt.staging.bytes_used == 0

    asyncio.run(go())


def test_kv_store_takes_blocks_and_serves_them_back(nats_url):
    """A worker offers blocks (KVPut), sends the ones the store lacks over the transport,
    and fetches them again (KVFetch) with their checksums; an unknown address is refused."""
    import zlib

    async def go():
        hub, s = LoopbackHub(), Subjects(f"t{next(_prefixes)}")
        cfg = KVStoreConfig(nats_url=nats_url, subject_prefix=s.prefix, worker_id="kv-t", capacity_mb=1,
                            staging_mb=1)  # beats every 1 s: a stranger is refused after 2.5 s
        async with KVStoreService(cfg, lambda: LoopbackTransport(hub)) as store:
            me = LoopbackTransport(hub)
            await me.start()
            nc = await nats.connect(nats_url)
            try:
                await publish(nc, s.heartbeat("prefill", "w-1"), Heartbeat("w-1", "prefill", "tiny", WorkerLoad(),
                                                                           address=me.address, interval_s=5))
                blocks = [bytes([i]) * 256 for i in range(3)]
                hashes = [bytes([i]) * 16 for i in range(3)]
                sums = [zlib.crc32(b) for b in blocks]
                put = await request(nc, s.kv_store_put, KVPut("w-1", hashes, sums, 768, b"k"), KVPutReply, 5)
                assert put.ok and put.wanted == [True, True, True]
                await me.send(put.address, b"".join(blocks), put.tag, 5)
                deadline = time.monotonic() + 5
                while not all(store.has(h) for h in hashes):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                again = await request(nc, s.kv_store_put, KVPut("w-1", hashes, sums, 768, b"k"), KVPutReply, 5)
                assert again.ok and again.wanted == [False, False, False]

                buf = bytearray(512)
                transfer = me.post_recv(buf, 7)
                got = await request(nc, s.kv_fetch("kv-t"), KVFetch(hashes[1:], me.address, 7, 512), KVFetchReply, 5)
                await transfer.wait(5)
                assert got.ok and got.checksums == sums[1:] and bytes(buf) == b"".join(blocks[1:])
                # An address no worker announces is refused once a few beats have gone by
                # without it, and holds up no other fetch meanwhile; a worker whose first beat
                # comes after its fetch is served.
                late = LoopbackTransport(hub)
                await late.start()
                late_buf = bytearray(256)
                late_rx = late.post_recv(late_buf, 9)
                stranger = asyncio.create_task(request(nc, s.kv_fetch("kv-t"), KVFetch(hashes, b"loopback-x", 8, 768),
                                                       KVFetchReply, 5))
                late_fetch = asyncio.create_task(request(nc, s.kv_fetch("kv-t"), KVFetch(hashes[:1], late.address, 9,
                                                                                         256), KVFetchReply, 5))
                await asyncio.sleep(0.3)
                await publish(nc, s.heartbeat("prefill", "w-2"), Heartbeat("w-2", "prefill", "tiny", WorkerLoad(),
                                                                           address=late.address, interval_s=5))
                got = await late_fetch
                await late_rx.wait(5)
                assert got.ok and bytes(late_buf) == blocks[0] and not stranger.done()
                refused = await stranger
                assert not refused.ok and "no live worker" in refused.error
                await late.close()
                assert store.staging.bytes_used == 0
            finally:
                await nc.close()
                await me.close()

    asyncio.run(go())


def test_balancer_answers_a_rebalance_of_an_unknown_instance_plainly(nats_url):
    async def go():
        s = Subjects(f"t{next(_prefixes)}")
        async with BalancerService(BalancerConfig(nats_url=nats_url, subject_prefix=s.prefix, auto=False)):
            nc = await nats.connect(nats_url)
            try:
                reply = await request(nc, s.eplb("decode-i9", "rebalance"), RebalanceRequest("decode-i9"),
                                      RebalanceReply, 5)
                assert not reply.ok and "has not reported loads yet" in reply.error
                bad = decode((await nc.request(s.eplb("decode-i9", "rebalance"), b"\xc1", timeout=5)).data,
                             ErrorReply)
                assert bad.code == "bad_request"
            finally:
                await nc.close()

    asyncio.run(go())


def test_an_abort_that_overtakes_its_job_or_hand_off_is_remembered(nats_url, tiny_model, tmp_path):
    """The gateway broadcasts an abort at once, while the job (to prefill) or the KV
    hand-off (to decode) may still be on its way: neither worker may then run it."""
    async def go():
        async with mesh(nats_url, tiny_model, tmp_path) as m:
            s = Subjects(m.prefix)
            nc = await nats.connect(nats_url)
            try:
                await publish(nc, s.abort, Abort(["late-job", "late-kv"]))
                await nc.flush()
                await asyncio.sleep(0.2)  # the workers have it before what it cancels arrives
                wire = WireSampling.from_params(SamplingParams(max_tokens=4))
                err = await request(nc, s.prefill_direct("prefill-t"),
                                    PrefillJob("late-job", [1, 2, 3], wire, "gw-t", "decode-t"), ErrorReply, 5)
                assert "aborted" in err.error
                item = KVReadyItem("late-kv", [1, 2, 3], [4], wire, "gw-t", 1, 1, 1)
                reply = await request(nc, s.decode_kv_ready("decode-t"),
                                      KVReady("prefill-t", b"loopback-x", m.decode.rt.kv_spec.wire, [item]),
                                      KVReadyReply, 5)
                assert reply.refused == {"late-kv": "aborted"}
                await _wait_free(m)
            finally:
                await nc.close()

    asyncio.run(go())


def test_a_gateway_that_falls_silent_has_its_requests_aborted(nats_url, tiny_model, tmp_path):
    """A killed gateway cannot stream to anyone: the workers notice its heartbeats stop
    and abort what they hold for it, instead of generating for nobody."""
    async def go():
        async with mesh(nats_url, tiny_model, tmp_path) as m:
            s = Subjects(m.prefix)
            nc = await nats.connect(nats_url)
            try:
                async def beat():
                    await publish(nc, s.heartbeat("gateway", "gw-x"),
                                  Heartbeat("gw-x", "gateway", "tiny", WorkerLoad(), interval_s=0.2))

                await beat()
                await nc.flush()
                await asyncio.sleep(0.1)
                wire = WireSampling.from_params(SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0))
                ack = await request(nc, s.prefill_direct("prefill-t"),
                                    PrefillJob("orphan", [1, 2, 3, 4, 5], wire, "gw-x", "decode-t"), Ack, 5)
                assert isinstance(ack, Ack)
                for _ in range(10):  # alive for a while: nothing is aborted
                    await beat()
                    await asyncio.sleep(0.1)
                assert "orphan" in m.decode.active or "orphan" in m.prefill.jobs or len(m.prefill.leases)
                await _wait_free(m, timeout=8.0)  # silent now: 3000 tokens would take far longer
                assert "orphan" in m.decode.aborted or "orphan" in m.prefill.aborted
            finally:
                await nc.close()

    asyncio.run(go())
