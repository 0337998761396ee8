"""The V4 batch metadata as first written: one chunk at a time, in plain loops. The
engine's HybridBatcher builds the same thing with a fixed number of vectorized ops;
tests/engine/test_hybrid_batch.py holds it to this one."""

from __future__ import annotations

import torch

from moemesh.shared.engine.runner import Chunk
from dataclasses import dataclass

from moemesh.shared.model.v4.batch import Extend, Groups, HybridMeta
from moemesh.shared.model.v4.config import CSA, SLIDING, V4Config


@dataclass
class Entries:
    """Entries as first written: every entry's address, per row, padded with zeros."""

    blk: torch.Tensor  # [R, E]
    slot: torch.Tensor  # [R, E]
    visible: torch.Tensor  # [rows]


class ReferenceBatcher:
    def __init__(self, cfg: V4Config, block_size: int):
        self.W, self.lookback, self.bs = cfg.sliding_window, cfg.lookback, block_size
        types = {cfg.layer_type(i) for i in range(cfg.num_hidden_layers)}
        self.rates = {t: cfg.rate(t) for t in sorted(types) if t != SLIDING}

    def __call__(self, chunks: list[Chunk], T: int, sliding_only: bool = False) -> HybridMeta:
        bs, W = self.bs, self.W
        rates = {} if sliding_only else self.rates
        pre_ring, pre_pos, w_ring, w_pos, w_end = [], [], [], [], []
        dec_keys: list[torch.Tensor] = []
        dec_rows: list[Chunk] = []
        groups = {t: ([], [], [], []) for t in rates}
        extends: list[Extend] = []
        n_pre = 0
        for c in chunks:
            seq, p, n, row0 = c.seq, c.start, c.q_len, c.row
            L = min(p, self.lookback)
            pre_ring.append(torch.full((L,), seq.ring, dtype=torch.long))
            pre_pos.append(torch.arange(p - L, p))
            prebase = T + n_pre - (p - L)
            n_pre += L

            def ctx(qs: torch.Tensor) -> torch.Tensor:
                return torch.where(qs < 0, -1, torch.where(qs >= p, row0 + qs - p, prebase + qs))

            w_ring.append(torch.full((n,), seq.ring, dtype=torch.long))
            w_pos.append(torch.arange(p, p + n))
            w_end.append(torch.full((n,), p + n, dtype=torch.long))
            if n == 1 and not extends:  # decode chunks come first (build_batch orders them)
                dec_keys.append(ctx(torch.arange(p - W + 1, p + 1)))
                dec_rows.append(c)
            else:
                extends.append(Extend(row0, n, ctx(torch.arange(p - W + 1, p + n))))
            if not rates:
                continue
            blocks = torch.tensor(seq.block_ids, dtype=torch.long)
            for t, m in rates.items():
                w = torch.arange(p // m, (p + n) // m)
                if len(w):
                    span = torch.arange(-m if t == CSA else 0, m)
                    g = groups[t]
                    g[0].append(ctx(w[:, None] * m + span[None, :]))
                    g[1].append(w * m)
                    g[2].append(blocks[(w * m) // bs])
                    g[3].append((w * m % bs) // m)
                if n > 1 or extends:
                    extends[-1].entries[t] = self._entries([(blocks, p + n)], m, torch.arange(p, p + n))
        meta = HybridMeta(
            pre_ring=_cat(pre_ring), pre_pos=_cat(pre_pos),
            write_ring=_cat(w_ring), write_pos=_cat(w_pos), write_end=_cat(w_end),
            num_decode=len(dec_rows),
            dec_keys=torch.stack(dec_keys) if dec_keys else torch.zeros(0, W, dtype=torch.long),
            extends=extends,
        )
        for t, m in rates.items():
            idx, pos, blk, slot = groups[t]
            span = 2 * m if t == CSA else m
            meta.groups[t] = Groups(
                torch.cat(idx) if idx else torch.zeros(0, span, dtype=torch.long),
                _cat(pos), _cat(blk), _cat(slot))
            if dec_rows:
                seqs = [(torch.tensor(c.seq.block_ids, dtype=torch.long), c.start + 1) for c in dec_rows]
                meta.dec_entries[t] = self._entries(seqs, m, torch.tensor([c.start for c in dec_rows]))
        return meta

    def _entries(self, seqs: list[tuple[torch.Tensor, int]], m: int, positions: torch.Tensor) -> Entries:
        """Addresses of each sequence's entries 0 .. end//m - 1, padded to the longest
        (padding points at entry 0 of block 0: masked, never read as a choice)."""
        bs = self.bs
        E = max(end // m for _, end in seqs)
        e = torch.arange(E)
        blk = torch.zeros(len(seqs), E, dtype=torch.long)
        slot = torch.zeros(len(seqs), E, dtype=torch.long)
        for r, (blocks, end) in enumerate(seqs):
            k = end // m
            blk[r, :k] = blocks[(e[:k] * m) // bs]
            slot[r, :k] = (e[:k] * m % bs) // m
        return Entries(blk, slot, (positions + 1) // m)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)
