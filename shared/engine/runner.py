"""Turns scheduled work into a ForwardBatch: token ids, positions, cache slots.

A *chunk* is the slice of one sequence computed in one forward: `q_len` tokens placed
at positions start .. start+q_len-1. Chunks with q_len == 1 go first in the packed
batch (the batched decode path); longer ones follow (the extend path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.sequence import Sequence
from shared.model.batch import ExtendSeq, ForwardBatch


@dataclass
class Chunk:
    seq: Sequence
    start: int
    token_ids: list[int]
    row: int = -1  # first row of this chunk in the packed batch, set by build_batch

    @property
    def q_len(self) -> int:
        return len(self.token_ids)


def build_batch(chunks: list[Chunk], block_size: int, device: torch.device | str = "cpu") -> ForwardBatch:
    """Orders chunks decode-first (in place) and packs them."""
    chunks.sort(key=lambda c: c.q_len > 1)
    ids: list[int] = []
    pos: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    extends: list[ExtendSeq] = []
    for c in chunks:
        c.row = len(ids)
        ids += c.token_ids
        blocks = torch.tensor(c.seq.block_ids, dtype=torch.long)
        end = c.start + c.q_len
        p = torch.arange(c.start, end)
        pos.append(p)
        slots.append(blocks[p // block_size] * block_size + p % block_size)
        if c.q_len == 1:
            decode_tables.append(c.seq.block_ids[: -(-end // block_size)])
            decode_lens.append(end)
        else:
            ctx = torch.arange(end)
            extends.append(ExtendSeq(c.row, c.q_len, end, blocks[ctx // block_size] * block_size + ctx % block_size))
    empty = torch.zeros(0, dtype=torch.long)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.cat(pos) if pos else empty,
        slot_mapping=torch.cat(slots) if slots else empty,
        num_decode=len(decode_lens),
        extends=extends,
    )
    if decode_lens:
        width = max(len(t) for t in decode_tables)
        batch.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables])
        batch.decode_context_lens = torch.tensor(decode_lens)
    return _to(batch, device)


def _to(batch: ForwardBatch, device) -> ForwardBatch:
    if torch.device(device).type == "cpu":
        return batch
    batch.input_ids = batch.input_ids.to(device)
    batch.positions = batch.positions.to(device)
    batch.slot_mapping = batch.slot_mapping.to(device)
    if batch.decode_block_tables is not None:
        batch.decode_block_tables = batch.decode_block_tables.to(device)
        batch.decode_context_lens = batch.decode_context_lens.to(device)
    for e in batch.extends:
        e.ctx_slots = e.ctx_slots.to(device)
    return batch
