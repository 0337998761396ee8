"""The KV-events loop batches a holder's changes; the peer check (protocol/registry.py) vets UCX addresses."""

from __future__ import annotations

import asyncio

from moemesh.shared.kv.events import KVEventPublisher
from moemesh.shared.protocol.messages import Heartbeat, WorkerLoad
from moemesh.shared.protocol.registry import KVPeers


def test_changes_of_several_steps_go_out_as_one_message_and_a_failed_send_is_survived():
    async def go():
        sent = []
        third = asyncio.Event()

        async def send(stored, removed):
            sent.append((stored, removed))
            if len(sent) == 3:
                third.set()
            if len(sent) == 1:
                raise ConnectionError("NATS reconnecting")

        pub = KVEventPublisher(send, batch_s=0.05)
        task = asyncio.create_task(pub.run())
        pub.add([b"a"], [b"x"])
        pub.add([b"b"])
        pub.add()  # nothing changed: nothing to send
        await asyncio.sleep(0.01)
        pub.add([b"c"])
        pub.add([b"d"], [b"y"])
        await asyncio.sleep(0.1)
        pub.publish_soon()
        await asyncio.wait_for(third.wait(), 5)  # not a fixed wait a stall could outlast
        task.cancel()
        assert sent == [([b"a", b"b"], [b"x"]), ([b"c", b"d"], [b"y"]), ([], [])]

    asyncio.run(go())


def test_only_announced_addresses_are_known():
    peers = KVPeers()
    assert not peers.knows(b"ucx-1")
    peers.observe(Heartbeat("w1", "decode", "m", WorkerLoad(), address=b"ucx-1"))
    peers.observe(Heartbeat("gw", "gateway", "m", WorkerLoad()))
    assert peers.knows(b"ucx-1") and not peers.knows(b"ucx-2") and not peers.knows(b"")
