"""Request migration: a decode worker that dies mid-stream (silent: no heartbeats, no
tokens) has its streams moved by the gateway to a live worker, as their prompt plus
what they streamed so far; every client gets its whole answer and a normal end."""

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
            await asyncio.sleep(1.0)
            victim = decs[1]
            assert victim.active  # it holds some of the streams
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
    assert took < 20  # 150 steps are 3 s; nothing waited for a 60 s timeout
    moved = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith(("moemesh_request_migrations_total ", "moemesh_request_migrations_total{")))
    assert 0 < moved <= STREAMS
