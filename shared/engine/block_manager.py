"""Paged KV block allocator: a free list plus reference counts.

Glossary: a *block* holds `block_size` consecutive token positions of one sequence in
every cache layer. A block may be referenced by several sequences (a shared prefix);
it returns to the free list only when its last reference is dropped.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
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
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check(self) -> None:
        """Exact accounting: every block is either free (ref 0) or referenced, never both."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, r in enumerate(self._refs):
            assert (r == 0) == (b in free), f"block {b}: refs={r}, on free list={b in free}"
