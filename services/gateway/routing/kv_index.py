"""Which holder (prefill or decode worker, KV store) has which KV block, by content hash,
kept from the holders' KVEvents. Pure data; the mesh client feeds it."""

from __future__ import annotations

from moemesh.shared.protocol.messages import KVEvents


class KVIndex:
    def __init__(self):
        self.blocks: dict[str, set[bytes]] = {}
        self.role: dict[str, str] = {}

    def apply(self, ev: KVEvents) -> None:
        held = self.blocks.setdefault(ev.holder_id, set())
        if ev.reset:
            held.clear()
        held.update(ev.stored)
        held.difference_update(ev.removed)
        self.role[ev.holder_id] = ev.role

    def forget(self, holder: str) -> None:
        self.blocks.pop(holder, None)
        self.role.pop(holder, None)

    def knows(self, holder: str) -> bool:
        return holder in self.blocks

    def overlap(self, holder: str, hashes: list[bytes]) -> int:
        """How many leading blocks of the hash chain the holder has."""
        held = self.blocks.get(holder)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n
