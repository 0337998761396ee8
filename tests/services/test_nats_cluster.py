"""A NATS node of a cluster dies with streams in flight: every service was on it (its own
host's node, listed first), and each fails over to the other node. No token is lost or
repeated: every stream's text is the one a run without the fault gives."""

from __future__ import annotations

import asyncio
import signal

import httpx

from moemesh.tools.launch.nats_server import NatsNode, client_urls, cluster_args, start_nats_cluster
from moemesh.tools.launch.procs import ProcessGroup, free_port
from tests.services.test_in_process import _wait_free, mesh

STREAMS, MAX_TOKENS = 12, 200


def test_cluster_args_route_to_every_other_node():
    nodes = [NatsNode(f"n{i}", f"10.0.0.{i}", 4222, 6222) for i in (1, 2, 3)]
    args = cluster_args(nodes[1], nodes)
    assert args[args.index("--routes") + 1] == "nats://10.0.0.1:6222,nats://10.0.0.3:6222"
    assert args[args.index("--cluster") + 1] == "nats://10.0.0.2:6222"
    assert client_urls(nodes, "n3") == "nats://10.0.0.3:4222,nats://10.0.0.1:4222,nats://10.0.0.2:4222"


def test_a_dead_nats_node_fails_over_and_loses_no_token(tiny_model, tmp_path):
    group = ProcessGroup(tmp_path / "nats")
    nodes = [NatsNode(f"nats-{i}", "127.0.0.1", free_port(), free_port()) for i in range(2)]
    first, _ = start_nats_cluster(group, nodes)

    async def go():
        async with mesh(client_urls(nodes, "nats-0"), tiny_model, tmp_path, engine="mock", mock_step_ms=20.0,
                        max_num_seqs=STREAMS) as m:
            async def one(i: int, c: httpx.AsyncClient) -> dict:
                r = await c.post(m.url + "/v1/completions", json={
                    "model": "tiny", "prompt": "same prompt", "max_tokens": MAX_TOKENS, "ignore_eos": True})
                return {"status": r.status_code, **(r.json() if r.status_code == 200 else {"text": r.text})}

            async with httpx.AsyncClient(timeout=60) as c:
                want = (await one(-1, c))["choices"][0]["text"]  # the mock's tokens depend on the position only
                assert m.decode.rt.nc.connected_url.port == nodes[0].port  # its own node, first in the list
                tasks = [asyncio.create_task(one(i, c)) for i in range(STREAMS)]
                await asyncio.sleep(1.5)  # every stream is generating (200 steps take 4 s or more)
                first.popen.send_signal(signal.SIGKILL)
                results = await asyncio.gather(*tasks)
            await _wait_free(m, timeout=15)
            return want, results, m.decode.rt.nc.connected_url.port

    try:
        want, results, port_after = asyncio.run(go())
    finally:
        group.stop()
    assert port_after == nodes[1].port
    bad = [r for r in results if r["status"] != 200]
    assert not bad, bad[:2]
    assert [r["usage"]["completion_tokens"] for r in results] == [MAX_TOKENS] * STREAMS
    assert [r["choices"][0]["text"] for r in results] == [want] * STREAMS
