"""Storage tiers of the KV store: blocks by content hash, each with its crc32.

MemoryTier: a byte capacity with LRU eviction. A block being read is pinned and is
never evicted; when everything left is pinned, a new block is refused instead.
DiskTier: one file per block (magic, crc32, length, bytes), written atomically, so it
survives a restart; a file whose bytes do not match its crc is deleted and treated as
a miss, never served.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

_MAGIC = b"MMKV1\x00"
_HEADER = struct.Struct("<6sIQ")


class MemoryTier:
    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.used = 0
        self._blocks: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self.evictions = 0

    def __contains__(self, h: bytes) -> bool:
        return h in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self) -> list[bytes]:
        return list(self._blocks)

    def get(self, h: bytes) -> tuple[bytes, int] | None:
        v = self._blocks.get(h)
        if v is not None:
            self._blocks.move_to_end(h)
        return v

    def put(self, h: bytes, data: bytes, crc: int) -> list[tuple[bytes, bytes, int]] | None:
        """Insert; returns the evicted (hash, data, crc) to spill, or None if it did not fit."""
        if h in self._blocks:
            self._blocks.move_to_end(h)
            return []
        evicted = []
        for old in list(self._blocks):
            if self.used + len(data) <= self.capacity:
                break
            if self._pins.get(old):
                continue  # being read: never evicted
            d, c = self._blocks.pop(old)
            self.used -= len(d)
            self.evictions += 1
            evicted.append((old, d, c))
        if self.used + len(data) > self.capacity:
            for old, d, c in evicted:  # could not make room: undo
                self._blocks[old] = (d, c)
                self.used += len(d)
                self.evictions -= 1
            return None
        self._blocks[h] = (data, crc)
        self.used += len(data)
        return evicted

    def pin(self, h: bytes) -> None:
        self._pins[h] = self._pins.get(h, 0) + 1

    def unpin(self, h: bytes) -> None:
        n = self._pins.get(h, 0) - 1
        if n > 0:
            self._pins[h] = n
        else:
            self._pins.pop(h, None)


class DiskTier:
    def __init__(self, root: str | Path, capacity_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self.corrupt = 0
        self.evictions = 0
        files = sorted(self.root.glob("*.kvb"), key=lambda p: p.stat().st_mtime)
        for f in files:  # reload what survived a restart
            try:
                self._sizes[bytes.fromhex(f.stem)] = f.stat().st_size
            except ValueError:
                f.unlink(missing_ok=True)

    @property
    def used(self) -> int:
        return sum(self._sizes.values())

    def __contains__(self, h: bytes) -> bool:
        return h in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def hashes(self) -> list[bytes]:
        return list(self._sizes)

    def _path(self, h: bytes) -> Path:
        return self.root / f"{h.hex()}.kvb"

    def put(self, h: bytes, data: bytes, crc: int) -> list[bytes]:
        """Write atomically; returns hashes evicted to stay within capacity."""
        if h in self._sizes:
            return []
        tmp = self._path(h).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, crc, len(data)))
            f.write(data)
        os.replace(tmp, self._path(h))
        self._sizes[h] = _HEADER.size + len(data)
        evicted = []
        while self.used > self.capacity and len(self._sizes) > 1:
            old, _ = self._sizes.popitem(last=False)
            self._path(old).unlink(missing_ok=True)
            self.evictions += 1
            evicted.append(old)
        return evicted

    def get(self, h: bytes) -> tuple[bytes, int] | None:
        if h not in self._sizes:
            return None
        try:
            raw = self._path(h).read_bytes()
            magic, crc, n = _HEADER.unpack_from(raw)
            data = raw[_HEADER.size :]
            if magic != _MAGIC or len(data) != n or zlib.crc32(data) != crc:
                raise ValueError("checksum mismatch")
        except (OSError, ValueError, struct.error):
            self.corrupt += 1
            self.drop(h)
            return None
        self._sizes.move_to_end(h)
        return data, crc

    def drop(self, h: bytes) -> None:
        self._sizes.pop(h, None)
        self._path(h).unlink(missing_ok=True)
