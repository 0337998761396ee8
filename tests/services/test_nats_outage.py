"""A NATS outage while streams are generating loses nothing: workers keep what they sent,
the gateway sees the gaps (every row carries its place in its stream) and asks for them
again when the connection is back, and nobody gives up on a peer because the link to
NATS, not the peer, was down."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port
from tests.services.test_in_process import _wait_free, mesh

STREAMS, MAX_TOKENS, OUTAGE_S = 16, 250, 10.0


def test_a_ten_second_nats_outage_loses_no_token(tiny_model, tmp_path):
    group = ProcessGroup(tmp_path / "nats")
    port = free_port()
    nats_url = f"nats://127.0.0.1:{port}"
    server = start_nats(group, port)

    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=20.0,
                        max_num_seqs=STREAMS) as m:
            async def one(i: int) -> dict:
                async with httpx.AsyncClient(timeout=120) as c:
                    r = await c.post(m.url + "/v1/completions", json={
                        "model": "tiny", "prompt": f"stream {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True})
                return {"status": r.status_code, **(r.json() if r.status_code == 200 else {"text": r.text})}

            tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
            await asyncio.sleep(1.5)  # all of them are generating (250 steps take 5 s or more)
            server.popen.send_signal(signal.SIGKILL)
            server.popen.wait()
            t0 = time.monotonic()
            await asyncio.sleep(OUTAGE_S)
            start_nats(group, port)
            results = await asyncio.gather(*tasks)
            took = time.monotonic() - t0
            await _wait_free(m, timeout=15)
            return results, took, m.decode.rt.tokens.resent_rows

    try:
        results, took, resent = asyncio.run(go())
    finally:
        group.stop()
    bad = [r for r in results if r["status"] != 200]
    assert not bad, bad[:2]
    assert [r["choices"][0]["finish_reason"] for r in results] == ["length"] * STREAMS
    assert [r["usage"]["completion_tokens"] for r in results] == [MAX_TOKENS] * STREAMS
    assert took < OUTAGE_S + 10  # recovered when the link came back, not by a timeout
    print(f"rows sent again after the outage: {resent}")
