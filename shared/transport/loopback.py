"""In-process transport: a test double beside UcxTransport, never a replacement.

Peers register in a shared hub under their address; a send copies into the buffer the
receiver posted under the same tag.
"""

from __future__ import annotations

import asyncio
import itertools

from moemesh.shared.transport.base import Transfer, TransferError

_ids = itertools.count()


class LoopbackHub:
    def __init__(self):
        self.peers: dict[bytes, "LoopbackTransport"] = {}


class LoopbackTransport:
    def __init__(self, hub: LoopbackHub):
        self.hub = hub
        self.address = f"loopback-{next(_ids)}".encode()
        self._posted: dict[int, tuple[object, asyncio.Future]] = {}
        self._early: dict[int, bytes] = {}

    async def start(self) -> None:
        self.hub.peers[self.address] = self

    async def close(self) -> None:
        self.hub.peers.pop(self.address, None)

    def post_recv(self, buf, tag: int) -> Transfer:
        fut = asyncio.get_running_loop().create_future()
        if tag in self._early:
            memoryview(buf).cast("B")[:] = self._early.pop(tag)
            fut.set_result(None)
        else:
            self._posted[tag] = (buf, fut)

        def try_cancel() -> bool:
            if self._posted.pop(tag, None) is not None:
                fut.cancel()
            return True  # copies happen synchronously in send(), so nothing can land later

        return Transfer(fut, memoryview(buf).nbytes, try_cancel)

    async def send(self, peer: bytes, buf, tag: int, timeout: float) -> None:
        dst = self.hub.peers.get(peer)
        if dst is None:
            raise TransferError(f"no loopback peer {peer!r}")
        data = bytes(memoryview(buf).cast("B"))
        posted = dst._posted.pop(tag, None)
        if posted is None:
            dst._early[tag] = data
            return
        rbuf, fut = posted
        mv = memoryview(rbuf).cast("B")
        if len(mv) != len(data):
            fut.set_exception(TransferError(f"size mismatch: posted {len(mv)}, sent {len(data)}"))
            raise TransferError("size mismatch")
        mv[:] = data
        fut.set_result(None)
