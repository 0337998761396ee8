"""Boundary snapshots: what makes a cached DeepSeek-V4 prefix usable (prefix reuse for V4).

A V4 block's main rows hold the compressed entries and index keys of its groups, but a
sequence that goes on from a block boundary b also reads the window keys and the
compressors' partial groups of the `lookback` positions before b, and those live in its
ring, overwritten as it moves on. A snapshot is a copy of a ring taken when the
sequence's computed positions reach b (the rows of positions b - lookback .. b - 1 are
then all in it, at slot q % span as in any ring), keyed by the chain hash of the block
that ends at b. A cached prefix is usable up to the deepest block whose hash has a
snapshot (and whose blocks are cached): a new sequence shares those blocks, gets the
snapshot copied into its own ring, and computes from b on.

Glossary:
- snapshot ring: one of `num_snapshots` rings after the sequences' rings in the cache's
  ring tensor, owned by this cache; running sequences never compete for them.
- pinned: promised to a sequence that has not run yet (its copy into the sequence's ring
  is queued in its first step); never evicted. Others are evicted least recently used.
- target: a boundary at which a sequence's prefill chunk is cut so that a snapshot can be
  taken there (a chunk that runs more than `ahead` positions past b overwrites rows the
  snapshot needs: a ring keeps lookback + ahead positions).

Which boundaries a sequence snapshots (`targets`, `boundary`): the last one of its
prompt that a repeat of the same tokens can use, the branch point where its cached
blocks run out of snapshots (the end of a shared system prompt is found so, by the
second request that shares it), and the newest boundary its decode passes (the next
turn of a conversation starts there); that one replaces its predecessor.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class SnapshotCache:
    def __init__(self, first_ring: int, num_snapshots: int):
        self.num_snapshots = num_snapshots
        self._free: deque[int] = deque(range(first_ring, first_ring + num_snapshots))
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # unpinned, least recently used first
        self._pinned: dict[bytes, list[int]] = {}  # hash -> [ring, pins]
        self._at: dict[bytes, int] = {}  # hash -> its boundary (position), for moving it by position
        self.num_evicted = 0

    @property
    def num_cached(self) -> int:
        return len(self._lru) + len(self._pinned)

    def has(self, h: bytes) -> bool:
        return h in self._lru or h in self._pinned

    def usable(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` a sequence can start on: the deepest one
        with a snapshot (the caller knows the blocks themselves are cached)."""
        for i in range(len(hashes), 0, -1):
            if self.has(hashes[i - 1]):
                return i
        return 0

    def pin(self, h: bytes) -> int:
        """The ring of h's snapshot, kept from eviction until `unpin`."""
        if h in self._pinned:
            self._pinned[h][1] += 1
        else:
            self._pinned[h] = [self._lru.pop(h), 1]
        return self._pinned[h][0]

    def unpin(self, h: bytes) -> None:
        entry = self._pinned[h]
        entry[1] -= 1
        if entry[1] == 0:
            del self._pinned[h]
            self._lru[h] = entry[0]  # just used: evicted last

    def take(self) -> int | None:
        """A ring to write a new snapshot into: a free one, else the least recently used
        unpinned snapshot's (evicted). None when every snapshot is pinned."""
        if self._free:
            return self._free.popleft()
        if not self._lru:
            return None
        self.num_evicted += 1
        h, ring = self._lru.popitem(last=False)
        del self._at[h]
        return ring

    def put(self, h: bytes, ring: int, boundary: int) -> bool:
        """File a written snapshot of the state at position `boundary` under h; a second
        copy of the same prefix is given back."""
        if self.has(h):
            self._free.append(ring)
            return False
        self._lru[h] = ring
        self._at[h] = boundary
        return True

    def boundary(self, h: bytes) -> int:
        return self._at[h]

    def ring(self, h: bytes) -> int:
        """The ring of a pinned snapshot."""
        return self._pinned[h][0]

    def give(self, ring: int) -> None:
        self._free.append(ring)

    def demote(self, h: bytes) -> None:
        """Make h's snapshot the first to go (a sequence's superseded newest boundary)."""
        if h in self._lru:
            self._lru.move_to_end(h, last=False)

    def check(self) -> None:
        rings = list(self._free) + list(self._lru.values()) + [r for r, _ in self._pinned.values()]
        assert len(rings) == len(set(rings)) == self.num_snapshots, "a snapshot ring is lost or owned twice"
        assert all(n > 0 for _, n in self._pinned.values())
        assert self._at.keys() == self._lru.keys() | self._pinned.keys()


def targets(num_computed: int, num_cached_blocks: int, num_tokens: int, block_size: int) -> list[int]:
    """Boundaries at which a sequence admitted at `num_computed` cuts its prefill and
    snapshots: the branch point (its cached blocks reach past the snapshot it starts on)
    and the last boundary a repeat of its tokens can use (one token is left to compute)."""
    bs = block_size
    out = []
    if num_cached_blocks * bs > num_computed:
        out.append(num_cached_blocks * bs)
    last = (num_tokens - 1) // bs * bs
    if last > num_computed and last not in out:
        out.append(last)
    return sorted(out)


def boundary(start: int, end: int, write_end: int, block_size: int, ahead: int) -> int:
    """The boundary b in (start, end] whose snapshot a step that computed positions up to
    `end` (and wrote ring rows up to `write_end`, drafts included) can take; 0 if none.
    Rows of b - lookback .. b - 1 are still in the ring while write_end - b <= ahead."""
    b = end // block_size * block_size
    return b if b > start and write_end - b <= ahead else 0


def usable_depth(snapshots: "SnapshotCache | None", hashes: list[bytes], hybrid: bool) -> int:
    """How many leading blocks of `hashes` (cached ones) a sequence can start on: on MLA
    all of them, a cached block being all the state there is; on V4 (hybrid) as deep as
    its deepest boundary snapshot, and none without snapshots. The one rule for the
    scheduler, admission and the blocks a worker serves its peers."""
    if not hybrid:
        return len(hashes)
    return snapshots.usable(hashes) if snapshots is not None else 0
