"""Paged KV block allocator: a free list, reference counts, and a prefix cache.

Glossary:
- block: `block_size` consecutive token positions of one sequence, in every cache layer.
- reference: a sequence using a block. A block shared by several sequences (a common
  prefix) returns to the free list only when its last reference is dropped.
- block hash: the content address of a full block (protocol/prefix_hash.py): equal prefixes
  have equal hashes on every worker.
- cached block: a full block whose hash is registered. When its last reference goes,
  it stays on the free list with its contents and hash: a later request with the same
  prefix takes it back instead of recomputing it. The free list is kept in LRU order,
  so allocation evicts the least recently freed cached block first.
- deferred block: freed while steps are in flight (the serving loop overlaps the host
  with the device and queues the next step early). Those steps may still write it, so
  it joins the free list only once the newest of them is done (`end_step`); until then
  it cannot be handed out and filled by an import.
- ring (DeepSeek-V4 only): the store of a sequence's recent positions (window keys,
  compressor projections) that it holds besides its blocks; taken with its first
  blocks (a parallel-sampling parent takes its children's too, engine/fork.py), given
  back with its last, and deferred like blocks while steps are in flight.
  The prefix cache's V4 ring snapshots are kept apart (snapshots.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, num_rings: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_rings = num_rings
        self._free_rings: deque[int] = deque(range(num_rings))
        self._deferred_rings: deque[tuple[int, int]] = deque()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._fence = -1  # the newest step in flight, -1: none
        self._deferred: deque[tuple[int, int]] = deque()  # (fence when freed, block), oldest first
        # KV events since the last drain: hashes that became available / stopped being.
        self.stored: list[bytes] = []
        self.removed: list[bytes] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self._refs[b] = 1
            out.append(b)
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._fence >= 0:
                    self._deferred.append((self._fence, b))
                else:
                    self._free[b] = None  # most recently freed: evicted last

    # ---- rings ------------------------------------------------------------------------
    @property
    def uses_rings(self) -> bool:
        return self.num_rings > 0

    @property
    def num_free_rings(self) -> int:
        return len(self._free_rings)

    def take_ring(self) -> int:
        if not self._free_rings:
            raise MemoryError("no free window ring")
        return self._free_rings.popleft()

    def give_ring(self, r: int) -> None:
        if self._fence >= 0:
            self._deferred_rings.append((self._fence, r))
        else:
            self._free_rings.append(r)

    def begin_step(self, step_id: int) -> None:
        """Step `step_id` (ids increase) is in flight: blocks freed from now on wait until it is done."""
        self._fence = step_id

    def end_step(self, step_id: int) -> None:
        """Steps up to `step_id` are done: blocks freed while only they were in flight are free."""
        d = self._deferred
        while d and d[0][0] <= step_id:
            b = d.popleft()[1]
            if self._refs[b] == 0 and b not in self._free:  # not taken back meanwhile
                self._free[b] = None
        dr = self._deferred_rings
        while dr and dr[0][0] <= step_id:
            self._free_rings.append(dr.popleft()[1])
        if step_id >= self._fence:
            self._fence = -1

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # ---- prefix cache ---------------------------------------------------------------------
    def register(self, block: int, h: bytes) -> None:
        """Record that `block` (in use, full, computed) holds the content with hash h."""
        if not self.enable_caching or block in self._hash_of:
            return
        if h in self._block_of:  # the same content computed twice: keep the first copy
            return
        self._hash_of[block] = h
        self._block_of[h] = block
        self.stored.append(h)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (no references taken)."""
        out = []
        if self.enable_caching:
            for h in hashes:
                b = self._block_of.get(h)
                if b is None:
                    break
                out.append(b)
        return out

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks, in use or free."""
        for b in blocks:
            if self._refs[b] == 0 and b in self._free:  # else a deferred block: end_step skips it
                del self._free[b]
            self._refs[b] += 1


    def cached_hashes(self) -> list[bytes]:
        return list(self._block_of)

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed

    def _evict(self, b: int) -> None:
        h = self._hash_of.pop(b, None)
        if h is not None:
            del self._block_of[h]
            self.removed.append(h)

    def check(self) -> None:
        """Exact accounting: every block is either free (ref 0) or referenced, never both."""
        deferred = {b for _, b in self._deferred if self._refs[b] == 0 and b not in self._free}
        for b, r in enumerate(self._refs):
            free = b in self._free or b in deferred
            assert (r == 0) == free, f"block {b}: refs={r}, on free list={b in self._free}, deferred={b in deferred}"
        assert len(self._free) + len(deferred) == sum(1 for r in self._refs if r == 0)
        for h, b in self._block_of.items():
            assert self._hash_of.get(b) == h, f"hash index out of step at block {b}"
        rings = list(self._free_rings) + [r for _, r in self._deferred_rings]
        assert len(rings) == len(set(rings)), "a ring is free twice"
