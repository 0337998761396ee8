"""Turns scheduled work into a ForwardBatch: token ids, positions, cache slots.

A *chunk* is the slice of one sequence computed in one forward: `q_len` tokens placed
at positions start .. start+q_len-1. Chunks of at most ROWWISE_MAX rows (a decode token,
or one with its MTP drafts to verify) go first in the packed batch, each row attended on
its own by the batched decode path, with its own position and context (its chunk's KV
is in the cache before attention, so that is causal attention); longer chunks (prompts)
follow, each on the extend path.
"""

from __future__ import annotations

from dataclasses import dataclass, is_dataclass

import numpy as np
import torch

from moemesh.shared.engine import host_copy
from moemesh.shared.engine.block_table import BlockTables
from moemesh.shared.engine.hybrid_batch import ROWWISE_MAX
from moemesh.shared.engine.sequence import Sequence
from moemesh.shared.model.batch import ExtendSeq, ForwardBatch


@dataclass(slots=True)
class Chunk:
    seq: Sequence
    start: int
    token_ids: list[int]
    row: int = -1  # first row of this chunk in the packed batch, set by build_batch

    @property
    def q_len(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Padding:
    """How build_batch pads a decode batch to a bucket of fixed shapes (decode_graphs.py)."""

    rows: int  # the bucket: rows in all, the padding after the batch's own
    block: int  # the scratch block, which no sequence owns
    ring: int  # DeepSeek-V4: the scratch ring; -1 for MLA
    max_len: int  # max_model_len: the block tables' width (V4: the compressed entries too)


def build_batch(chunks: list[Chunk], block_size: int, device: torch.device | str = "cpu",
                hybrid=None, pad: Padding | None = None, tables: BlockTables | None = None,
                row_keys: bool = False) -> ForwardBatch:
    """Orders chunks rowwise-first (in place, stable) and packs them. One pass reads each
    chunk's tokens; positions, slots and tables are then a fixed number of array ops over
    the whole batch, on the rows `tables` keeps for its sequences.
    hybrid: a V4 engine's HybridBatcher, None for MLA.
    pad: one-token chunks only, padded to pad.rows rows of fixed shapes.
    tables: the engine's BlockTables (None: a throwaway one for these chunks).
    row_keys: give each row its sequence's key (batch.row_keys), for a model that asks."""
    rmax = hybrid.rowwise_max if hybrid is not None else ROWWISE_MAX
    lens = [len(c.token_ids) for c in chunks]
    if lens and max(lens) > rmax:  # prompts after the rows attended one by one
        order = sorted(range(len(chunks)), key=lambda i: lens[i] > rmax)
        chunks[:] = [chunks[i] for i in order]
        lens = [lens[i] for i in order]
    ids: list[int] = []
    for c in chunks:
        c.row = len(ids)
        ids += c.token_ids
    seqs = [c.seq for c in chunks]
    if tables is None:
        tables = BlockTables.for_seqs(seqs)
    T = len(ids)
    if pad is not None:  # token 0 at position 0 of the scratch block, attending to itself
        ids += [0] * (pad.rows - T)
        tables.widen(-(-pad.max_len // block_size))
        tables.set_pad(pad.block)
    input_ids = torch.tensor(ids, dtype=torch.long)
    num_decode = lens.count(1)  # decode rows, for the step's stats
    keys = _row_keys(chunks, lens, len(ids)) if row_keys else None
    if hybrid is not None:  # V4 reads its cache through the batch's HybridMeta alone
        meta = hybrid(chunks, len(ids), pad, tables)
        return _to(ForwardBatch(input_ids=input_ids, positions=meta.write_pos, slot_mapping=_NO_SLOTS,
                                num_decode=num_decode, hybrid=meta, static=pad is not None, row_keys=keys), device)

    bs, C = block_size, len(chunks)
    n = np.array(lens, dtype=_I)
    start = np.fromiter((c.start for c in chunks), dtype=_I, count=C)
    row0 = np.cumsum(n) - n
    trows = tables.rows(seqs)
    Bd = int(np.searchsorted(n > rmax, True))  # chunks attended row by row, first
    R = int(row0[Bd]) if Bd < C else T
    if R == Bd:  # one row each (a plain decode step)
        rc, pos = np.arange(Bd), start[:Bd]
    else:
        rc = np.repeat(np.arange(Bd), n[:Bd])
        pos = start[rc] + np.arange(R) - row0[rc]
    trow = trows[rc]
    if pad is not None:
        pos = np.concatenate([pos, np.zeros(pad.rows - T, dtype=_I)])
        trow = np.concatenate([trow, np.full(pad.rows - T, tables.pad_row, dtype=_I)])
    table = tables.ids
    positions, slots = pos, table[trow, pos // bs] * bs + pos % bs
    extends: list[ExtendSeq] = []
    if Bd < C:  # each prompt chunk's whole context, all of them at once
        ends = start[Bd:] + n[Bd:]
        off = np.cumsum(ends) - ends
        ec = np.repeat(np.arange(C - Bd), ends)
        ctx = np.arange(int(ends.sum())) - off[ec]
        ctx_slots = table[trows[Bd:][ec], ctx // bs] * bs + ctx % bs
        own = ctx >= start[Bd:][ec]  # the chunk's own positions (the rest is its cached context)
        positions = np.concatenate([positions, ctx[own]])
        slots = np.concatenate([slots, ctx_slots[own]])
        cs = torch.from_numpy(ctx_slots)
        extends = [ExtendSeq(int(row0[i]), lens[i], int(ends[i - Bd]), cs[o : o + e])
                   for i, o, e in zip(range(Bd, C), off.tolist(), ends.tolist())]
    batch = ForwardBatch(
        input_ids=input_ids,
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        num_decode=num_decode,
        num_rowwise=len(pos),
        extends=extends,
        static=pad is not None,
        row_keys=keys,
    )
    if len(pos):
        nb = pos // bs + 1  # blocks each row sees
        width = -(-pad.max_len // bs) if pad is not None else int(nb.max())
        cols = np.arange(width)
        batch.decode_block_tables = torch.from_numpy(np.where(cols[None, :] < nb[:, None], table[trow, :width], 0))
        batch.decode_context_lens = torch.from_numpy(pos + 1)
    return _to(batch, device)


_NO_SLOTS = torch.zeros(0, dtype=torch.long)
_I = np.int64


def _row_keys(chunks: list[Chunk], lens: list[int], rows: int) -> torch.Tensor:
    """[rows] each row's sequence key; padding rows 0."""
    keys = np.zeros(rows, dtype=_I)
    keys[: sum(lens)] = np.repeat(np.fromiter((c.seq.key for c in chunks), dtype=_I, count=len(chunks)), lens)
    return torch.from_numpy(keys)


def index_tensors(batch: ForwardBatch) -> list[tuple[object, object]]:
    """(holder, key) of every tensor the batch hands the device: ids, positions, slots,
    tables, and V4's HybridMeta with its groups, entries and extends."""
    out: list[tuple[object, object]] = []

    def walk(holder, items) -> None:
        for k, v in items:
            if isinstance(v, torch.Tensor):
                out.append((holder, k))
            elif isinstance(v, dict):
                walk(v, v.items())
            elif isinstance(v, list):
                walk(v, enumerate(v))
            elif is_dataclass(v) and not isinstance(v, type):
                walk(v, vars(v).items())

    walk(batch, ((k, v) for k, v in vars(batch).items() if k != "packed"))
    return out


def _to(batch: ForwardBatch, device) -> ForwardBatch:
    if torch.device(device).type == "cpu":
        return batch
    return pack(batch, lambda flat: host_copy.send(flat, device))


def pack(batch: ForwardBatch, move) -> ForwardBatch:
    """One copy to the device for the whole batch: its index tensors (int64) travel packed
    in one buffer (`move` copies it) and come apart as views, where a copy each would be
    a launch each (about thirty for a V4 batch)."""
    slots = [(h, k) for h, k in index_tensors(batch) if _get(h, k).dtype == torch.long]
    if not slots:
        return batch
    parts = [_get(h, k) for h, k in slots]
    dev = batch.packed = move(torch.cat([t.reshape(-1) for t in parts]))
    offset = 0
    for (h, k), t in zip(slots, parts):
        _set(h, k, dev[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return batch


def _get(holder, key):
    return holder[key] if isinstance(holder, (dict, list)) else getattr(holder, key)


def _set(holder, key, value) -> None:
    if isinstance(holder, (dict, list)):
        holder[key] = value
    else:
        setattr(holder, key, value)
