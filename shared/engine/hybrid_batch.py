"""Builds a V4 batch's HybridMeta from the scheduled chunks (see shared/model/v4/batch.py).

For each chunk of `n` positions p .. p+n-1 of one sequence:
- pre positions: the `lookback` positions before p, read back from the ring;
- ring writes: every row, with its chunk's end; a region of span s keeps a row only if
  it is among the chunk's last s positions: `keep[s]` lists those rows with their ring
  and slot, and `pre_slot[s]` the pre positions' slots, so that the forward reads and
  writes each region with one index op and asks the device nothing;
- window keys: positions t-W+1 .. t for each row (decode), or p-W+1 .. p+n-1 shared by
  the chunk's rows (extend);
- groups completing in the chunk: entries w with p <= (w+1)*m - 1 < p+n, that is
  w in [p // m, (p+n) // m);
- entries: the sequence's entries 0 .. (p+n)//m - 1, of which row t sees (t+1)//m.

Everything per row, group or decode sequence is computed for the whole batch at once:
a fixed number of array ops on the host (numpy: a tenth of a torch op's overhead, and
the results become tensors without a copy), whatever the batch size. Only the chunks'
scalars are read one chunk at a time; block tables are rows the engine keeps for its
sequences (block_table.py), gathered with one op. Extend chunks
(prefill, draft verification) still get their own key lists and entries.
tests/engine/hybrid_batch_ref.py keeps the chunk-at-a-time version as the reference.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from moemesh.shared.engine.block_table import BlockTables
from moemesh.shared.model.v4.batch import Entries, Extend, Groups, HybridMeta
from moemesh.shared.model.v4.config import CSA, SLIDING, V4Config

_I = np.int64
# Chunks this short (a decode row, or one with its MTP drafts to verify) are attended row
# by row with the decode rows: one batched path, where a chunk at a time would be a loop
# over the batch's sequences. Longer ones (prefill) share their keys across their rows.
ROWWISE_MAX = 8


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=_I))


class HybridBatcher:
    def __init__(self, cfg: V4Config, block_size: int, spans: tuple[int, ...] = (), rowwise_max: int = ROWWISE_MAX):
        """spans: the ring regions' slot counts (layout.py), for the rows each keeps.
        rowwise_max: chunks of at most this many rows are attended row by row."""
        self.W, self.lookback, self.bs = cfg.sliding_window, cfg.lookback, block_size
        self.rowwise_max = rowwise_max
        self._window = np.arange(-self.W + 1, 1)
        self.spans = tuple(sorted(set(spans)))
        types = {cfg.layer_type(i) for i in range(cfg.num_hidden_layers)}
        self.rates = {t: cfg.rate(t) for t in sorted(types) if t != SLIDING}

    def sliding(self) -> HybridBatcher:
        """The MTP layer's batcher: it attends over the window only (no entries, no groups)."""
        view = copy.copy(self)
        view.rates = {}
        return view

    def __call__(self, chunks, T: int, pad=None, tables: BlockTables | None = None) -> HybridMeta:
        """tables: the engine's BlockTables (None: a throwaway one for these chunks).
        pad (runner.Padding; from build_batch, whose tables hold the padding row): one-token
        chunks, padded to pad.rows rows whose every size is its most (decode_graphs.py): a
        full look-back for every row, a group slot for every row (one that completes no
        group writes the scratch block), and as many entries as pad.max_len holds."""
        bs, W = self.bs, self.W
        rates = self.rates
        lens = [len(c.token_ids) for c in chunks]
        p = np.fromiter((c.start for c in chunks), dtype=_I, count=len(chunks))
        ring = np.fromiter((c.seq.ring for c in chunks), dtype=_I, count=len(chunks))
        row0 = np.fromiter((c.row for c in chunks), dtype=_I, count=len(chunks))
        if pad is not None:  # padding rows: position 0 of the scratch ring
            extra = pad.rows - len(chunks)
            lens += [1] * extra
            p = np.concatenate([p, np.zeros(extra, dtype=_I)])
            ring = np.concatenate([ring, np.full(extra, pad.ring, dtype=_I)])
            row0 = np.concatenate([row0, np.arange(len(chunks), pad.rows, dtype=_I)])
        C = len(lens)
        n = np.array(lens, dtype=_I)
        end = p + n
        look = np.minimum(p, self.lookback) if pad is None else np.full(C, self.lookback, dtype=_I)
        pre_start = np.cumsum(look) - look  # each chunk's first pre row, counted from T
        prebase = T + pre_start - (p - look)
        ids = np.arange(C)

        inside = row0 - p  # ctx index minus position, for a position in its chunk
        one_row = T == C  # every chunk one row (a plain decode step): chunk i is row i

        def ctx(q: np.ndarray, c: np.ndarray | None) -> np.ndarray:
            """ctx indices of positions q of chunks c (broadcast; None: chunk i for row i)."""
            if c is None:
                start, a, b = p[:, None], inside[:, None], prebase[:, None]
            else:
                start, a, b = p[c], inside[c], prebase[c]
            return np.where(q < 0, -1, q + np.where(q >= start, a, b))

        pre_c = np.repeat(ids, look)
        if one_row:
            row_c, write_pos, write_end, w_ring = ids, p, end, ring
        else:
            row_c = np.repeat(ids, n)
            write_pos = p[row_c] + np.arange(T) - row0[row_c]
            write_end, w_ring = end[row_c], ring[row_c]
        # build_batch puts the short chunks first; their rows are attended one
        # by one, each with its own window and entries, as decode rows are.
        long = n > self.rowwise_max
        Bd = int(long.argmax()) if long.any() else C
        R = int(row0[Bd]) if Bd < C else T  # rows of the first Bd chunks
        rc, rpos = row_c[:R], write_pos[:R]
        pre_pos = p[pre_c] - look[pre_c] + np.arange(len(pre_c)) - pre_start[pre_c]
        meta = HybridMeta(
            pre_ring=_t(ring[pre_c]), pre_pos=_t(pre_pos),
            write_ring=_t(w_ring), write_pos=_t(write_pos), write_end=_t(write_end),
            num_decode=R,
            dec_keys=_t(ctx(rpos[:, None] + self._window[None, :], None if one_row else rc[:, None])),
        )
        for s in self.spans:
            keep = np.flatnonzero(write_pos >= write_end - s)
            meta.keep[s], meta.keep_ring[s], meta.keep_slot[s] = _t(keep), _t(w_ring[keep]), _t(write_pos[keep] % s)
            meta.pre_slot[s] = _t(pre_pos % s)
        for i in range(Bd, C):
            c = chunks[i]
            meta.extends.append(Extend(c.row, c.q_len, _t(ctx(np.arange(c.start - W + 1, c.start + c.q_len), i))))
        if not rates or not C:
            for t, m in rates.items():
                meta.groups[t] = Groups(torch.zeros(0, 2 * m if t == CSA else m, dtype=torch.long), *_none(3))
            return meta
        need = (end + bs - 1) // bs
        width = int(need.max()) if pad is None else -(-pad.max_len // bs)
        seqs = [c.seq for c in chunks]
        tables = tables or BlockTables.for_seqs(seqs)
        trow = tables.rows(seqs)
        if pad is not None:  # build_batch widened the table and filled its padding row
            trow = np.concatenate([trow, np.full(pad.rows - len(chunks), tables.pad_row, dtype=_I)])
        # [C, blocks] block ids, zero past the blocks each chunk reaches
        table = np.where(np.arange(width)[None, :] < need[:, None], tables.ids[trow, :width], 0)
        for t, m in rates.items():
            span = np.arange(-m if t == CSA else 0, m)
            if pad is None:
                first, count = p // m, end // m - p // m
                grp_c = np.repeat(ids, count)
                w = first[grp_c] + np.arange(len(grp_c)) - (np.cumsum(count) - count)[grp_c]
                meta.groups[t] = Groups(_t(ctx(w[:, None] * m + span[None, :], grp_c[:, None])), _t(w * m),
                                        _t(table[grp_c, (w * m) // bs]), _t((w * m % bs) // m))
            else:  # a slot per row: the group its position completes, or one pooling row 0 into scratch
                done = end % m == 0
                w = np.where(done, p // m, 0)
                idx = np.where(done[:, None], ctx(w[:, None] * m + span[None, :], ids[:, None]), 0)
                meta.groups[t] = Groups(_t(idx), _t(w * m), _t(np.where(done, table[ids, (w * m) // bs], pad.block)),
                                        _t(np.where(done, (w * m % bs) // m, 0)))
            if R:
                meta.dec_entries[t] = _entries(table if one_row else table[rc], rpos + 1, m, bs, (rpos + 1) // m,
                                               None if pad is None else pad.max_len // m)
            for i, ext in enumerate(meta.extends, start=Bd):
                ext.entries[t] = _entries(table[i : i + 1], end[i : i + 1], m, bs,
                                          (np.arange(p[i], end[i]) + 1) // m)
        return meta


def _entries(table: np.ndarray, end: np.ndarray, m: int, bs: int, visible: np.ndarray,
             count: int | None = None) -> Entries:
    """Each sequence's entries 0 .. end//m - 1, as its block table and the longest count
    (or `count`); the table is cut to the blocks those entries need."""
    E = count if count is not None else int((end // m).max()) if len(end) else 0
    return Entries(_t(table[:, : -(-E * m // bs)]), E, _t(visible))


def _none(k: int) -> list[torch.Tensor]:
    return [torch.zeros(0, dtype=torch.long) for _ in range(k)]
