"""DeepSeek-V4 in the KV store: a prefix is kept as its blocks' rows plus the boundary
snapshot at its end (a record of its own), and a worker that never saw a conversation
starts the next turn on it, with the answers of one engine without any cache.

In one process (a real nats-server, the loopback transport in place of UCX): the point
is what the store keeps and serves, not how the bytes travel."""

from __future__ import annotations

import asyncio
import time
import zlib
from contextlib import AsyncExitStack

import httpx
import nats

from moemesh.services.decode.config import DecodeConfig
from moemesh.services.decode.service import DecodeService
from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.service import GatewayService
from moemesh.services.kv_store.config import KVStoreConfig
from moemesh.services.kv_store.service import KVStoreService
from moemesh.services.prefill.config import PrefillConfig
from moemesh.services.prefill.service import PrefillService
from moemesh.shared.protocol.messages import (
    Heartbeat, KVEvents, KVFetch, KVFetchReply, KVPut, KVPutReply, WorkerLoad, decode,
)
from moemesh.shared.protocol.prefix_hash import is_snapshot_key, snapshot_key
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.nats_io import publish, request
from moemesh.shared.transport.loopback import LoopbackHub, LoopbackTransport
from tests.mesh.test_v4_reuse import TURNS as REUSE_TURNS
from tests.mesh.test_v4_reuse import _message, _want, no_reuse  # noqa: F401 (no_reuse: a fixture)

_prefixes = iter(range(1_000_000))


def test_the_store_keeps_a_snapshot_beside_its_blocks_and_serves_only_as_deep_as_one(nats_url):
    async def go():
        hub, s = LoopbackHub(), Subjects(f"v4s{next(_prefixes)}")
        cfg = KVStoreConfig(nats_url=nats_url, subject_prefix=s.prefix, worker_id="kv-t", capacity_mb=1, staging_mb=1)
        async with KVStoreService(cfg, lambda: LoopbackTransport(hub)) as store:
            me = LoopbackTransport(hub)
            await me.start()
            nc = await nats.connect(nats_url)
            seen = []

            async def on_events(m):
                seen.append(m.data)

            await nc.subscribe(s.kv_events("*"), cb=on_events)
            try:
                await publish(nc, s.heartbeat("prefill", "w-1"), Heartbeat("w-1", "prefill", "tiny", WorkerLoad(),
                                                                           address=me.address, interval_s=5))
                blocks = [bytes([i]) * 64 for i in range(3)]
                snap = b"\x07" * 100  # a different size from a block
                hashes = [bytes([i]) * 16 for i in range(3)]
                sums = [zlib.crc32(b) for b in blocks + [snap]]
                put = KVPut("w-1", hashes[:2], sums[:2] + [sums[3]], 228, b"k", snapshot_nbytes=100)
                got = await request(nc, s.kv_store_put, put, KVPutReply, 5)
                assert got.ok and got.wanted == [True, True, True]
                await me.send(got.address, blocks[0] + blocks[1] + snap, got.tag, 5)
                deadline = time.monotonic() + 5
                while not store.has(snapshot_key(hashes[1])):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                # The third block arrives alone, with no snapshot at its end.
                put = KVPut("w-1", hashes[2:], sums[2:3], 64, b"k")
                got = await request(nc, s.kv_store_put, put, KVPutReply, 5)
                await me.send(got.address, blocks[2], got.tag, 5)
                while not store.has(hashes[2]):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)

                async def depth(hs, snapshot=True):
                    r = await request(nc, s.kv_fetch("kv-t"), KVFetch(hs, me.address, 0, 0, snapshot=snapshot,
                                                                      depth_only=True), KVFetchReply, 5)
                    return r.num_blocks

                assert await depth(hashes) == 2  # blocks 0-2 held, a snapshot only at the end of 1
                assert await depth(hashes, snapshot=False) == 3
                assert await depth([b"x" * 16] + hashes) == 0

                buf = bytearray(228)
                transfer = me.post_recv(buf, 9)
                reply = await request(nc, s.kv_fetch("kv-t"), KVFetch(hashes[:2], me.address, 9, 228, snapshot=True),
                                      KVFetchReply, 5)
                await transfer.wait(5)
                assert reply.ok and reply.checksums == sums[:2] + [sums[3]]
                assert bytes(buf) == blocks[0] + blocks[1] + snap
                # All or nothing: no snapshot at the end of block 2, and a size that does not add up.
                for f in (KVFetch(hashes, me.address, 10, 292, snapshot=True),
                          KVFetch(hashes[:2], me.address, 11, 200, snapshot=True)):
                    assert not (await request(nc, s.kv_fetch("kv-t"), f, KVFetchReply, 5)).ok
                bad = KVPut("w-1", hashes[:1], sums[:1], 164, b"k", snapshot_nbytes=100)  # a checksum short
                assert not (await request(nc, s.kv_store_put, bad, KVPutReply, 5)).ok
                assert store.staging.bytes_used == 0
                await asyncio.sleep(0.2)  # the events of the last put are out
            finally:
                await nc.close()
                await me.close()
            # Snapshots are not announced: no prompt's hash chain names them.
            announced = [h for raw in seen for h in decode(raw, KVEvents).stored]
            assert set(announced) == set(hashes) and not any(is_snapshot_key(h) for h in announced)

    asyncio.run(go())


TURNS = REUSE_TURNS[:2]
MAX_TOKENS = 20  # the first answer's decode passes a block boundary


async def _turn(url: str, msgs: list[dict]) -> str:
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": msgs, "temperature": 0,
                                                             "max_tokens": MAX_TOKENS, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def _until(cond, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_a_conversation_continues_from_the_store_on_workers_that_never_saw_it(nats_url, tiny_v4_model, tmp_path,
                                                                              no_reuse):
    """Turn 1 runs on one prefill and one decode worker, which offer the prefix (blocks and
    snapshot) to the store; both go, and turn 2 runs on new workers whose only source is
    the store."""
    want = _want(no_reuse, TURNS, MAX_TOKENS)

    async def go():
        prefix, hub = f"v4s{next(_prefixes)}", LoopbackHub()
        common = dict(nats_url=nats_url, model=tiny_v4_model, subject_prefix=prefix, served_model_name="tiny",
                      heartbeat_interval_s=0.2, staging_mb=16, num_kv_blocks=256)

        def workers(n: int):
            return (PrefillService(PrefillConfig(worker_id=f"prefill-{n}", **common), None,
                                   lambda: LoopbackTransport(hub)),
                    DecodeService(DecodeConfig(worker_id=f"decode-{n}", **common), None,
                                  lambda: LoopbackTransport(hub)))

        store_cfg = KVStoreConfig(nats_url=nats_url, subject_prefix=prefix, worker_id="kv-t", capacity_mb=16,
                                  staging_mb=16, heartbeat_interval_s=0.2)
        async with AsyncExitStack() as stack:
            store = await stack.enter_async_context(KVStoreService(store_cfg, lambda: LoopbackTransport(hub)))
            first = AsyncExitStack()
            pre, dec = [await first.enter_async_context(w) for w in workers(1)]
            gw = await stack.enter_async_context(GatewayService(GatewayConfig(
                nats_url=nats_url, model=tiny_v4_model, subject_prefix=prefix, served_model_name="tiny", port=0,
                worker_id="gw-t")))
            url = f"http://127.0.0.1:{gw.port}"

            async def one_each():
                deadline = time.monotonic() + 15
                async with httpx.AsyncClient(timeout=5) as c:
                    while (w := (await c.get(url + "/health")).json()["workers"]) != {**w, "prefill": 1, "decode": 1}:
                        assert time.monotonic() < deadline, w
                        await asyncio.sleep(0.05)

            await one_each()
            msgs = [_message(TURNS[0])]
            got = [await _turn(url, msgs)]
            msgs += [{"role": "assistant", "content": got[0]}, _message(TURNS[1])]
            # The decode worker offers the prompt and answer up to its newest snapshot.
            await _until(lambda: sum(is_snapshot_key(h) for h in store.mem.hashes()) >= 2, "no snapshots stored")
            await first.aclose()
            second = await stack.enter_async_context(AsyncExitStack())
            pre2, dec2 = [await second.enter_async_context(w) for w in workers(2)]
            await one_each()
            got.append(await _turn(url, msgs))
            return got, pre2.rt.kv_sharing.pulled_tokens, store

    got, pulled, store = asyncio.run(go())
    assert got == want
    assert pulled >= 2 * 16  # turn 2 started on the first turn's prefix, from the store
    assert store.c_blocks.labels("hit")._value.get() > 0
