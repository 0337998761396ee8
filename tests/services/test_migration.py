"""Request migration: a worker that dies mid-stream (silent: no heartbeats, no tokens)
has its streams moved by the gateway to a live worker, as their prompt plus what they
streamed so far; every client gets its whole answer and a normal end. A worker found
gone before its heartbeats lapse (nobody answers on its subject) gets no new requests,
and a request its prefill worker hands elsewhere is not moved again.

At temperature 0 the mock engine's token at each position is a function of the position
alone, so the same prompt gives the same text on any worker, after any number of moves:
a lost or repeated token shows as a text that differs from the others."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import httpx

from moemesh.services.decode.config import DecodeConfig
from moemesh.services.decode.service import DecodeService
from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.service import GatewayService
from moemesh.services.prefill.config import PrefillConfig
from moemesh.services.prefill.service import PrefillService
from moemesh.shared.protocol.messages import SamplingParams, TokenBatch, decode
from moemesh.shared.transport.loopback import LoopbackHub, LoopbackTransport

STREAMS, MAX_TOKENS = 12, 150
_prefixes = iter(range(1_000_000))


def test_streams_of_a_dead_decode_worker_move_and_finish_whole(nats_url, tiny_model, tmp_path):
    async def go():
        prefix, hub = f"mig{next(_prefixes)}", LoopbackHub()
        common = dict(nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny",
                      heartbeat_interval_s=0.25, staging_mb=16, num_kv_blocks=256, engine="mock",
                      mock_step_ms=20.0)
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(PrefillService(PrefillConfig(worker_id="prefill-m", **common), None,
                                                           lambda: LoopbackTransport(hub)))
            decs = [await stack.enter_async_context(DecodeService(
                DecodeConfig(worker_id=f"decode-m{i}", **common), None, lambda: LoopbackTransport(hub)))
                for i in range(2)]
            gw = await stack.enter_async_context(GatewayService(GatewayConfig(
                nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny", port=0,
                worker_id="gw-m")))
            url = f"http://127.0.0.1:{gw.port}"
            async with httpx.AsyncClient(timeout=60) as c:
                while (await c.get(url + "/health")).json()["workers"]["decode"] < 2:
                    await asyncio.sleep(0.05)

            async def one(i: int) -> dict:
                async with httpx.AsyncClient(timeout=60) as c:
                    r = await c.post(url + "/v1/completions", json={
                        "model": "tiny", "prompt": f"stream {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True})
                return {"status": r.status_code, **(r.json() if r.status_code == 200 else {"text": r.text})}

            t0 = time.monotonic()
            tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
            victim = decs[1]
            # It holds some of the streams, mid-way: not after a fixed sleep, which a loaded
            # machine can spend before any stream gets that far.
            await _until(lambda: victim.active and all(h.next_pos > 1 for h in gw.state.mesh.handles.values()))
            # Dies as a killed process does, to the mesh: its heartbeats and tokens stop.
            await victim.rt.heartbeat.stop()
            await victim.rt.bus.nc.close()
            results = await asyncio.gather(*tasks)
            took = time.monotonic() - t0
            async with httpx.AsyncClient(timeout=10) as c:
                metrics = (await c.get(url + "/metrics")).text
            return results, took, metrics

    results, took, metrics = asyncio.run(go())
    bad = [r for r in results if r["status"] != 200]
    assert not bad, bad[:2]
    assert [r["choices"][0]["finish_reason"] for r in results] == ["length"] * STREAMS
    assert [r["usage"]["completion_tokens"] for r in results] == [MAX_TOKENS] * STREAMS
    assert took < 45  # 150 steps are 3 s; nothing waited for the 60 s timeout (loose: a loaded machine is slow)
    moved = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith(("moemesh_request_migrations_total ", "moemesh_request_migrations_total{")))
    assert 0 < moved <= STREAMS


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


async def _complete(url: str, prompt: str, max_tokens: int, **extra) -> dict:
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra})
    return {"status": r.status_code, **(r.json() if r.status_code == 200 else {"text": r.text})}


async def _until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _kill(svc) -> None:
    """Dies as a killed process does, to the mesh: its heartbeats and messages stop."""
    await svc.rt.heartbeat.stop()
    await svc.rt.nc.close()


def test_queued_jobs_of_a_dead_prefill_worker_move_and_finish_whole(nats_url, tiny_model):
    async def go():
        prefix, hub = f"mig{next(_prefixes)}", LoopbackHub()
        common = dict(nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny",
                      heartbeat_interval_s=0.25, staging_mb=16, num_kv_blocks=256, engine="mock",
                      mock_step_ms=20.0)
        async with AsyncExitStack() as stack:
            # Its one step takes 2 s: the jobs it takes are still there, with no first token, when it dies.
            victim = await stack.enter_async_context(PrefillService(
                PrefillConfig(worker_id="prefill-z", **{**common, "mock_step_ms": 2000.0}), None,
                lambda: LoopbackTransport(hub)))
            await stack.enter_async_context(PrefillService(PrefillConfig(worker_id="prefill-a", **common), None,
                                                           lambda: LoopbackTransport(hub)))
            await stack.enter_async_context(DecodeService(DecodeConfig(worker_id="decode-m", **common), None,
                                                          lambda: LoopbackTransport(hub)))
            gw = await stack.enter_async_context(GatewayService(GatewayConfig(
                nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny", port=0,
                worker_id="gw-p", inactivity_timeout_s=30)))
            url = f"http://127.0.0.1:{gw.port}"
            mesh = gw.state.mesh
            await _until(lambda: len(mesh.live("prefill")) == 2 and mesh.live("decode"))

            t0 = time.monotonic()
            tasks = [asyncio.create_task(_complete(url, "the same prompt", MAX_TOKENS, temperature=0))
                     for _ in range(STREAMS)]
            # Every job taken (acknowledged), some of them by the victim.
            await _until(lambda: len(mesh.handles) == STREAMS and not mesh._sending and victim.jobs)
            held = len(victim.jobs)
            assert all(h.next_pos == 0 for h in mesh.handles.values() if h.prefill_id == "prefill-z")
            await _kill(victim)
            results = await asyncio.gather(*tasks)
            took = time.monotonic() - t0
            return results, took, held, gw.state.metrics.render()[0].decode()

    results, took, held, metrics = asyncio.run(go())
    bad = [r for r in results if r["status"] != 200]
    assert not bad, bad[:2]
    assert [r["choices"][0]["finish_reason"] for r in results] == ["length"] * STREAMS
    assert [r["usage"]["completion_tokens"] for r in results] == [MAX_TOKENS] * STREAMS
    assert len({r["choices"][0]["text"] for r in results}) == 1  # every token, in place, on any worker
    assert took < 45  # nothing waited for the 60 s timeout (loose: a loaded machine is slow)
    assert held <= _metric(metrics, "moemesh_request_migrations_total") <= STREAMS


def test_a_request_for_a_decode_worker_that_just_died_is_handed_to_another_and_not_moved(nats_url, tiny_model,
                                                                                        caplog):
    """The gateway still counts the dead worker live (1 s beats: 2 s to notice) and sends it
    a request; the prefill worker finds nobody there, hands the KV to the other decode
    worker and says so. The gateway takes that worker's tokens, sends the dead one nothing
    more, and does not move the request when the dead worker's heartbeats lapse."""
    async def go():
        prefix, hub = f"mig{next(_prefixes)}", LoopbackHub()
        common = dict(nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny",
                      heartbeat_interval_s=1.0, staging_mb=16, num_kv_blocks=256, engine="mock",
                      mock_step_ms=20.0)
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(PrefillService(PrefillConfig(worker_id="prefill-m", **common), None,
                                                           lambda: LoopbackTransport(hub)))
            # decode-a wins the tie between two idle workers.
            victim, _ = [await stack.enter_async_context(DecodeService(
                DecodeConfig(worker_id=f"decode-{x}", **common), None, lambda: LoopbackTransport(hub)))
                for x in "ab"]
            gw = await stack.enter_async_context(GatewayService(GatewayConfig(
                nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny", port=0,
                worker_id="gw-h", heartbeat_interval_s=1.0, inactivity_timeout_s=30)))
            url = f"http://127.0.0.1:{gw.port}"
            mesh = gw.state.mesh
            await _until(lambda: len(mesh.live("decode")) == 2 and mesh.live("prefill"))
            await _kill(victim)
            first = asyncio.create_task(_complete(url, "the same prompt", MAX_TOKENS, temperature=0))
            await _until(lambda: any(h.decode_id == "decode-b" for h in mesh.handles.values()))
            assert [hb.worker_id for hb in mesh.live("decode")] == ["decode-b"]  # before its beats lapse
            first = await first
            after = await _complete(url, "the same prompt", MAX_TOKENS, temperature=0)
            return first, after, gw.state.metrics.render()[0].decode()

    with caplog.at_level("WARNING"):
        first, after, metrics = asyncio.run(go())
    assert first["status"] == 200 and after["status"] == 200, (first, after)
    assert first["usage"]["completion_tokens"] == MAX_TOKENS
    assert first["choices"][0]["text"] == after["choices"][0]["text"]
    assert _metric(metrics, "moemesh_request_migrations_total") == 0
    assert _metric(metrics, "moemesh_token_rows_refused_total") == 0
    assert "worker decode-a is suspect" in caplog.text


def _dies_at(svc, position: int, killed: list[str]) -> None:
    """The worker dies, to the mesh, instead of sending the token batch that reaches a
    stream's `position`: at a fixed place in the stream, however fast its engine runs.
    Only the first worker that gets there dies."""
    nc = svc.rt.nc
    publish = nc.publish

    async def publish_or_die(subject: str, payload: bytes = b"", *args, **kw):
        if not killed and ".tokens." in subject:
            b = decode(payload, TokenBatch)
            counts = b.counts if b.counts is not None else [1] * len(b.request_ids)
            if any(p + n > position for p, n in zip(b.positions, counts)):
                killed.append(svc.rt.worker_id)
                await _kill(svc)
                return
        return await publish(subject, payload, *args, **kw)

    nc.publish = publish_or_die


def test_a_migrated_stream_equals_an_uninterrupted_run_on_the_model_at_temperature_0(
        nats_url, tiny_model, tiny_engine_factory, offline):
    """The real engine (the tiny random-weight model, MTP drafting on): the decode worker
    serving the stream dies after 12 of its 32 tokens, the stream moves to the other decode
    worker as prompt plus what it had, and the client's text is the offline engine's."""
    prompt, max_tokens, killed = "Hello world", 32, []

    async def go():
        prefix, hub = f"mig{next(_prefixes)}", LoopbackHub()
        common = dict(nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny",
                      heartbeat_interval_s=0.25, staging_mb=16, num_kv_blocks=256)
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(PrefillService(
                PrefillConfig(worker_id="prefill-r", **common), tiny_engine_factory(role="prefill", num_kv_blocks=256),
                lambda: LoopbackTransport(hub)))
            for i in range(2):
                dec = await stack.enter_async_context(DecodeService(
                    DecodeConfig(worker_id=f"decode-r{i}", **common),
                    tiny_engine_factory(role="decode", num_kv_blocks=256), lambda: LoopbackTransport(hub)))
                _dies_at(dec, 12, killed)
            gw = await stack.enter_async_context(GatewayService(GatewayConfig(
                nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny", port=0,
                worker_id="gw-r", inactivity_timeout_s=30)))
            mesh = gw.state.mesh
            await _until(lambda: len(mesh.live("decode")) == 2 and mesh.live("prefill"))
            got = await _complete(f"http://127.0.0.1:{gw.port}", prompt, max_tokens, temperature=0)
            return got, gw.state.metrics.render()[0].decode()

    got, metrics = asyncio.run(go())
    want = offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    assert got["status"] == 200, got
    assert killed and _metric(metrics, "moemesh_request_migrations_total") == 1
    assert got["usage"]["completion_tokens"] == max_tokens
    assert got["choices"][0]["text"] == want.text
