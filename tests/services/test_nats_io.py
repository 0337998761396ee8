"""A service that stops while the NATS server is gone still closes its connection
cleanly (and so exits 0), rather than raising from a flush into a dead socket."""

from __future__ import annotations

import asyncio

from moemesh.services.gateway.config import GatewayConfig
from moemesh.shared.service.nats_io import connect, disconnect
from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port


def test_disconnect_with_the_server_gone_does_not_raise(tmp_path):
    group = ProcessGroup(tmp_path)
    port = free_port()
    start_nats(group, port)

    async def main():
        nc = await connect(GatewayConfig(model="m", nats_url=f"nats://127.0.0.1:{port}"), "t")
        await nc.publish("x", b"1")
        group.stop()  # the server goes away; the client starts reconnecting
        for _ in range(100):
            if nc.is_reconnecting:
                break
            await asyncio.sleep(0.05)
        await nc.publish("x", b"2")  # buffered for a server that is not coming back
        await disconnect(nc)
        assert nc.is_closed

    asyncio.run(main())
