"""The running sequences' block tables, as rows of one preallocated array.

A step's batch needs each of its sequences' block ids as one [rows, width] index array
(MLA's decode tables, V4's group and entry addresses). Copying every sequence's list
into a fresh array each step is work per sequence and per block; here each sequence
keeps a row, refreshed only when its list changed, and a step takes its rows with one
gather.

A row mirrors `seq.block_ids`. The lists only grow in place (the scheduler appends the
blocks a sequence grows into) or are replaced by another list (admission, a fork, an
import, a preemption); nothing edits an element in place. So a row is up to date while
it holds the same list object, as many ids as that list has: a longer list copies its
new tail, another list the whole row.

Rows belong to whoever asks for them last. A row whose sequence is not in the batch being
built may be handed to another sequence (its own gets a new row when it comes back: a
copy, never a wrong table), so no one has to tell the table when a sequence ends.
"""

from __future__ import annotations

import numpy as np

_I = np.int64


class BlockTables:
    def __init__(self, num_rows: int, width: int):
        """num_rows: sequences a step may hold (rows grow past it if needed); width: the
        most blocks a sequence holds (grows too). One more row, the last, is the padding's."""
        num_rows, width = max(num_rows, 1), max(width, 1)
        self.ids = np.zeros((num_rows + 1, width), dtype=_I)
        self._owner: list[object] = [None] * num_rows  # the sequence each row mirrors
        self._src: list[list[int] | None] = [None] * num_rows  # the list it was copied from
        self._held = [0] * num_rows  # ids copied from it
        self._free = list(range(num_rows - 1, -1, -1))

    @classmethod
    def for_seqs(cls, seqs) -> BlockTables:
        """A table just for these sequences (callers that keep none)."""
        return cls(len(seqs), max((len(s.block_ids) for s in seqs), default=1))

    @property
    def pad_row(self) -> int:
        """A row no sequence owns, for a padded batch's rows (set_pad fills it)."""
        return len(self._owner)

    def set_pad(self, block: int) -> int:
        """The padding row: `block` first, zeros after. Returns its index."""
        self.ids[self.pad_row] = 0
        self.ids[self.pad_row, 0] = block
        return self.pad_row

    def widen(self, width: int) -> None:
        """At least `width` columns (a padded batch reads them all)."""
        if width > self.ids.shape[1]:
            self.ids = np.concatenate([self.ids, np.zeros((self.ids.shape[0], width - self.ids.shape[1]), _I)], 1)

    def rows(self, seqs) -> np.ndarray:
        """[len(seqs)] the row of each sequence, each up to date with its block_ids."""
        out = []
        owner, src, held = self._owner, self._src, self._held
        for s in seqs:
            r = s.table_row
            if r < 0 or r >= len(owner) or owner[r] is not s:
                r = self._take(s, seqs)
            b = s.block_ids
            if src[r] is not b:
                self._copy(r, b, 0)
                src[r] = b
            elif held[r] != len(b):
                self._copy(r, b, held[r])
            out.append(r)
        return np.array(out, dtype=_I)

    def _copy(self, r: int, blocks: list[int], start: int) -> None:
        n, was = len(blocks), self._held[r]
        if n > self.ids.shape[1]:
            self.widen(2 * n)
        if n < start:  # never by growth in place; a list that shrank is copied whole
            start = 0
        self.ids[r, start:n] = blocks[start:n]
        if was > n:
            self.ids[r, n:was] = 0
        self._held[r] = n

    def _take(self, seq, batch) -> int:
        if not self._free:
            live = {id(s) for s in batch}
            self._free = [r for r in range(len(self._owner) - 1, -1, -1) if id(self._owner[r]) not in live]
            for r in self._free:  # their sequences get new rows if they come back
                self._owner[r] = self._src[r] = None
            if not self._free:  # more sequences in one batch than rows: twice the rows
                self._grow()
        r = self._free.pop()
        self._owner[r], self._src[r] = seq, None
        seq.table_row = r
        return r

    def _grow(self) -> None:
        n = len(self._owner)
        ids = np.zeros((2 * n + 1, self.ids.shape[1]), _I)
        ids[:n] = self.ids[:n]
        ids[2 * n] = self.ids[n]  # the padding row stays last
        self.ids = ids
        self._owner += [None] * n
        self._src += [None] * n
        self._held += [0] * n
        self._free = list(range(2 * n - 1, n - 1, -1))

    def check(self, seqs) -> None:
        """Each sequence's row holds its block ids, zeros after them."""
        rows = self.rows(seqs)
        for s, r in zip(seqs, rows.tolist()):
            n = len(s.block_ids)
            assert self.ids[r, :n].tolist() == list(s.block_ids), f"row {r} of {s.request_id} out of date"
            assert not self.ids[r, n:].any(), f"row {r} of {s.request_id} holds stale ids"
