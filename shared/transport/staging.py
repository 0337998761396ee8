"""Transfer staging memory: one buffer allocated (and registered) once, carved into ranges.

KV bytes are gathered into a staging range and sent from there, and received into a
staging range and scattered from there into the cache. Allocating the buffer once
matters: UCX registers memory on first use and caches the registration, and receiving
into fresh allocations runs several times slower than into memory touched before.

`StagedReceive` is one receive into a staging range, from reservation to release.
States (TransferState, polled through `state`, never by blocking):
1. BOOTSTRAPPING: staging memory reserved, the receive not posted yet;
2. WAITING_FOR_INPUT: the receive is posted under `tag`, and the sender can be asked;
3. TRANSFERRING: bytes are landing in the staging range;
4. SUCCESS: the bytes are in `slot`, until the caller releases it; or
   FAILED (`error` says why): staging full, the ask refused, a timeout, a broken
   transfer, or cancellation.

A failure abandons the receive first and frees the staging range only once nothing can
land in it any more; if bytes are landing right then, the range is freed when they have
landed. That clean-up lives here and nowhere else.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import torch

from moemesh.shared.transport.base import KVTransport, Transfer, TransferError, TransferState

log = logging.getLogger(__name__)
T = TypeVar("T")

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
        self._mapping: mmap.mmap | None = None
        if device.type == "cpu" and not torch.cuda.is_available():
            self.buf = self._huge_pages(capacity_bytes)
        else:
            pin = device.type == "cpu"
            self.buf = torch.empty(capacity_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
        if device.type == "cpu":
            self.buf.zero_()  # touch every page now, not during the first transfer
        self.alloc_ = RangeAllocator(capacity_bytes)
        if self._mapping is not None:
            huge = self.huge_page_bytes()
            log.info("host staging: %d MiB, %d MiB of it on huge pages%s", capacity_bytes >> 20, huge >> 20,
                     "" if huge else " (transparent huge pages off or not granted: transfers from 1 MiB up "
                     "run slower; see /sys/kernel/mm/transparent_hugepage/enabled)")

    def _huge_pages(self, nbytes: int) -> torch.Tensor:
        """Host staging on transparent huge pages where the kernel gives them. A transfer
        between processes of one host is the kernel reading the sender's pages
        (process_vm_readv, UCX's cma), and on 4 KiB pages it walks 512 times as many:
        1 MiB moved 1.6x faster, 16 MiB 1.7x, here. A private mapping, 2 MiB aligned,
        because shared anonymous memory follows the stricter shmem policy."""
        huge = 2 << 20
        self._mapping = mmap.mmap(-1, max(nbytes, 1) + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError as e:  # a kernel without THP: 4 KiB pages, slower but correct
                log.info("staging memory without huge pages: %s", e)
        whole = torch.frombuffer(self._mapping, dtype=torch.uint8)
        start = (-whole.data_ptr()) % huge
        return whole[start : start + nbytes]

    def huge_page_bytes(self) -> int:
        """Bytes of this pool's host mapping the kernel backs with huge pages right now
        (AnonHugePages in /proc/self/smaps; 0 when it cannot tell). The kernel merges
        adjacent anonymous mappings of the same flags into one entry, whose figure then
        counts a neighbour's huge pages too: hence at most the pool's own size."""
        if self._mapping is None:
            return 0
        try:
            granted = int(mapping_fields(self.buf.data_ptr()).get("AnonHugePages", "0 kB").split()[0]) << 10
        except ValueError:
            return 0
        return min(granted, self.buf.numel())

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


def mapping_fields(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds addr ({} when unreadable)."""
    fields: dict[str, str] = {}
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and not head[0].endswith(":"):
                    if inside:
                        break
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    inside = lo <= addr < hi
                elif inside and head:
                    fields[head[0].rstrip(":")] = " ".join(head[1:])
    except (OSError, ValueError):
        return {}
    return fields


class StagedReceive:
    def __init__(self, transport: KVTransport, staging: StagingPool, nbytes: int, what: str = "KV"):
        """Reserves nbytes of staging; if it is full the receive starts FAILED."""
        self._transport, self._staging = transport, staging
        self.nbytes = nbytes
        self.tag = random.getrandbits(62)
        self.transfer: Transfer | None = None
        self.error = ""
        self.slot: StagingSlot | None = staging.alloc(nbytes)
        if self.slot is None:
            self.error = f"{what} staging memory full ({nbytes} bytes needed)"

    @property
    def state(self) -> TransferState:
        if self.error:
            return TransferState.FAILED
        if self.transfer is None:
            return TransferState.BOOTSTRAPPING
        return self.transfer.state

    def post(self) -> None:
        """Post the receive: from here the sender may send under `tag`."""
        if self.slot is not None and self.transfer is None:
            self.transfer = self._transport.post_recv(self.slot.buffer(), self.tag)

    async def wait(self, timeout: float) -> None:
        """Wait for the bytes. Raises TransferError, the receive already abandoned."""
        if self.error:
            raise TransferError(self.error)
        self.post()
        try:
            await self.transfer.wait(timeout)
        except BaseException as e:
            self.fail(str(e) or type(e).__name__)
            raise

    async def run(self, ask: Callable[[int], Awaitable[T]], timeout: float) -> T:
        """Post the receive, ask the sender for the bytes (ask(tag), which raises to
        refuse), then wait for them: the ask and the bytes within `timeout` together, so a
        slow answer leaves the bytes less time rather than doubling the wait. Returns
        ask's answer. On any failure the receive is abandoned, and the exception goes on."""
        if self.error:
            raise TransferError(self.error)
        end = time.monotonic() + timeout
        self.post()
        try:
            answer = await ask(self.tag)
        except BaseException as e:
            self.fail(str(e) or type(e).__name__)
            raise
        await self.wait(max(0.01, end - time.monotonic()))
        return answer

    def fail(self, error: str) -> None:
        """Give up: abandon the receive and free the staging range once certainly free."""
        if not self.error:
            self.error = error
        slot, self.slot = self.slot, None
        if slot is None:
            return
        if self.transfer is None or self.transfer.cancel():
            self._staging.free(slot)
        else:  # bytes are landing: the range is free only once they have landed
            log.warning("a receive into %d staging bytes is still running; freeing them when it ends", slot.nbytes)
            self.transfer.add_done_callback(lambda _t: self._staging.free(slot))

    def release(self) -> None:
        """The bytes are used up (or not wanted): free the staging range. Safe to call
        twice, and after a failure."""
        if self.state != TransferState.SUCCESS:
            self.fail(self.error or "released before its bytes arrived")
            return
        slot, self.slot = self.slot, None
        if slot is not None:
            self._staging.free(slot)

