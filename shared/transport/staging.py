"""Transfer staging memory: one buffer allocated (and registered) once, carved into ranges.

KV bytes are gathered into a staging range and sent from there, and received into a
staging range and scattered from there into the cache. Allocating the buffer once
matters: UCX registers memory on first use and caches the registration, and receiving
into fresh allocations runs several times slower than into memory touched before.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

ALIGN = 256


class RangeAllocator:
    """First-fit allocator over [0, capacity) with coalescing of freed neighbours."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []  # sorted (offset, size)
        self._used: dict[int, int] = {}

    @property
    def bytes_used(self) -> int:
        return sum(self._used.values())

    def alloc(self, nbytes: int) -> int | None:
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + size, n - size)
                self._used[off] = size
                return off
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # merge with the right, then the left neighbour
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    def check(self) -> None:
        spans = sorted(list(self._free) + list(self._used.items()))
        pos = 0
        for off, n in spans:
            assert off == pos, f"gap or overlap at {off} (expected {pos})"
            pos += n
        assert pos == self.capacity


@dataclass
class StagingSlot:
    offset: int
    nbytes: int
    tensor: torch.Tensor  # uint8 view of exactly nbytes

    def typed(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.tensor.view(dtype).view(shape)

    def part(self, offset: int, nbytes: int) -> "StagingSlot":
        """A range of this slot (it is not allocated on its own: never free it)."""
        return StagingSlot(self.offset + offset, nbytes, self.tensor[offset : offset + nbytes])

    def buffer(self):
        """An object exposing the buffer (host) or CUDA array interface, for UCX."""
        return self.tensor.numpy() if self.tensor.device.type == "cpu" else self.tensor


class StagingPool:
    def __init__(self, capacity_bytes: int, device: str | torch.device = "cpu"):
        device = torch.device(device)
        pin = device.type == "cpu" and torch.cuda.is_available()
        self.buf = torch.empty(capacity_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
        if device.type == "cpu":
            self.buf.zero_()  # touch every page now, not during the first transfer
        self.alloc_ = RangeAllocator(capacity_bytes)

    @property
    def capacity(self) -> int:
        return self.alloc_.capacity

    @property
    def bytes_used(self) -> int:
        return self.alloc_.bytes_used

    def alloc(self, nbytes: int) -> StagingSlot | None:
        off = self.alloc_.alloc(nbytes)
        if off is None:
            return None
        return StagingSlot(off, nbytes, self.buf[off : off + nbytes])

    def free(self, slot: StagingSlot) -> None:
        self.alloc_.free(slot.offset)
