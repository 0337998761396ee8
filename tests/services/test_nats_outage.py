"""A NATS outage while streams are generating loses nothing: workers keep what they sent,
the gateway sees the gaps (every row carries its place in its stream) and asks for them
again when the connection is back, and nobody gives up on a peer because the link to
NATS, not the peer, was down. Requests that arrive during the outage wait for the link
and are served once it is back."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port
from tests.services.test_in_process import _wait_free, mesh

STREAMS, MAX_TOKENS, OUTAGE_S = 16, 250, 10.0
LATE = 3  # requests sent during the outage


def test_a_ten_second_nats_outage_loses_no_token(tiny_model, tmp_path):
    group = ProcessGroup(tmp_path / "nats")
    port = free_port()
    nats_url = f"nats://127.0.0.1:{port}"
    server = start_nats(group, port)

    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=20.0,
                        max_num_seqs=STREAMS) as m:
            async def one(i: int, max_tokens: int = MAX_TOKENS) -> dict:
                async with httpx.AsyncClient(timeout=120) as c:
                    r = await c.post(m.url + "/v1/completions", json={
                        "model": "tiny", "prompt": f"stream {i}", "max_tokens": max_tokens, "ignore_eos": True})
                return {"status": r.status_code, **(r.json() if r.status_code == 200 else {"text": r.text})}

            tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
            await asyncio.sleep(1.5)  # all of them are generating (250 steps take 5 s or more)
            server.popen.send_signal(signal.SIGKILL)
            server.popen.wait()
            t0 = time.monotonic()
            # Early in the outage: both of the job's 5 s sends would be over before NATS is back.
            await asyncio.sleep(0.5)
            late = [asyncio.create_task(one(100 + i, 20)) for i in range(LATE)]
            await asyncio.sleep(OUTAGE_S - 0.5)
            start_nats(group, port)
            results = await asyncio.gather(*tasks)
            took = time.monotonic() - t0
            late_results = await asyncio.gather(*late)
            await _wait_free(m, timeout=15)
            return results, took, m.decode.rt.tokens.resent_rows, late_results

    try:
        results, took, resent, late = asyncio.run(go())
    finally:
        group.stop()
    bad = [r for r in results if r["status"] != 200]
    assert not bad, bad[:2]
    assert [r["choices"][0]["finish_reason"] for r in results] == ["length"] * STREAMS
    assert [r["usage"]["completion_tokens"] for r in results] == [MAX_TOKENS] * STREAMS
    assert took < OUTAGE_S + 10  # recovered when the link came back, not by a timeout
    # Sent while NATS was down: held until it was back (not a 503), then served whole.
    assert [r["status"] for r in late] == [200] * LATE, late[:1]
    assert [r["usage"]["completion_tokens"] for r in late] == [20] * LATE
    print(f"rows sent again after the outage: {resent}")
