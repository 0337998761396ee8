"""The V4 boundary-snapshot cache and its policy, as pure logic."""

from __future__ import annotations

import random

from moemesh.shared.engine.snapshots import SnapshotCache, boundary, targets


def test_pinned_snapshots_are_never_evicted_and_lru_goes_first():
    c = SnapshotCache(first_ring=4, num_snapshots=3)
    rings = [c.take() for _ in range(3)]
    assert rings == [4, 5, 6] and c.take() is None  # nothing free, nothing filed yet
    for h, r in zip((b"a", b"b", b"c"), rings):
        assert c.put(h, r, 16)
    assert c.usable([b"x", b"a", b"y", b"c", b"z"]) == 4  # the deepest with a snapshot
    assert c.pin(b"a") == 4 and c.pin(b"a") == 4
    assert c.take() == 5 and not c.has(b"b")  # b is the least recently used unpinned one
    c.give(5)
    c.demote(b"c")
    c.unpin(b"a")
    assert c.take() == 5 and c.take() == 6  # the free one, then c, demoted in front of a
    assert c.take() is None  # a is still pinned once: it cannot go
    c.unpin(b"a")
    c.give(5)
    c.give(6)
    c.check()


def test_a_second_copy_of_a_prefix_is_given_back():
    c = SnapshotCache(0, 2)
    r0, r1 = c.take(), c.take()
    assert c.put(b"h", r0, 16) and not c.put(b"h", r1, 16)
    assert c.take() == r1
    c.give(r1)
    c.check()


def test_random_pins_and_takes_never_lose_a_ring():
    rng = random.Random(0)
    c = SnapshotCache(8, 5)
    pins: list[bytes] = []
    for i in range(2000):
        op = rng.random()
        if op < 0.4:
            r = c.take()
            if r is not None:
                c.put(str(rng.randrange(12)).encode(), r, 16)
        elif op < 0.7 and c.num_cached:
            hs = [h for h in (str(k).encode() for k in range(12)) if c.has(h)]
            h = rng.choice(hs)
            c.pin(h)
            pins.append(h)
        elif pins:
            c.unpin(pins.pop(rng.randrange(len(pins))))
        c.check()
    for h in pins:
        c.unpin(h)
    c.check()


def test_targets_and_boundaries():
    # Admitted at 32 on a snapshot, blocks cached to 64, 90 tokens: branch point 64, last usable 80.
    assert targets(32, 4, 90, 16) == [64, 80]
    assert targets(0, 0, 64, 16) == [48]  # one token is always left to compute
    assert targets(48, 3, 64, 16) == []
    # A chunk 40..64 (writing to 64) may snapshot 64; one 40..70 runs 6 past it: 2 draft slots kept.
    assert boundary(40, 64, 64, 16, 2) == 64
    assert boundary(40, 70, 70, 16, 2) == 0
    assert boundary(63, 65, 66, 16, 4) == 64  # a decode step with drafts
    assert boundary(64, 66, 66, 16, 2) == 0  # nothing crossed
