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
    """Orders chunks decode-first (in place) and packs them. Decode chunks are the bulk at
    large batch sizes, so their slots and tables are computed in plain Python ints and
    turned into tensors once; extend chunks use tensor ops per chunk."""
    chunks.sort(key=lambda c: len(c.token_ids) > 1)
    ids: list[int] = []
    dec_pos: list[int] = []
    dec_slots: list[int] = []
    decode_tables: list[list[int]] = []
    ext_pos: list[torch.Tensor] = []
    ext_slots: list[torch.Tensor] = []
    extends: list[ExtendSeq] = []
    bs = block_size
    for c in chunks:
        c.row = len(ids)
        n = len(c.token_ids)
        ids += c.token_ids
        blocks = c.seq.block_ids
        p = c.start
        if n == 1:
            dec_pos.append(p)
            dec_slots.append(blocks[p // bs] * bs + p % bs)
            decode_tables.append(blocks[: p // bs + 1])
            continue
        bt = torch.tensor(blocks, dtype=torch.long)
        ctx = torch.arange(p + n)
        ctx_slots = bt[ctx // bs] * bs + ctx % bs
        ext_pos.append(ctx[p:])
        ext_slots.append(ctx_slots[p:])
        extends.append(ExtendSeq(c.row, n, p + n, ctx_slots))
    positions = torch.tensor(dec_pos, dtype=torch.long)
    slots = torch.tensor(dec_slots, dtype=torch.long)
    if ext_pos:
        positions = torch.cat([positions, *ext_pos])
        slots = torch.cat([slots, *ext_slots])
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=positions,
        slot_mapping=slots,
        num_decode=len(dec_pos),
        extends=extends,
    )
    if dec_pos:
        width = max(len(t) for t in decode_tables)
        batch.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables])
        batch.decode_context_lens = torch.tensor([x + 1 for x in dec_pos])
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
