"""Turns scheduled work into a ForwardBatch: token ids, positions, cache slots.

A *chunk* is the slice of one sequence computed in one forward: `q_len` tokens placed
at positions start .. start+q_len-1. Chunks of at most ROWWISE_MAX rows (a decode token,
or one with its MTP drafts to verify) go first in the packed batch, each row attended on
its own by the batched decode path, with its own position and context (its chunk's KV
is in the cache before attention, so that is causal attention); longer chunks (prompts)
follow, each on the extend path.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, is_dataclass

import torch

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
                hybrid=None, pad: Padding | None = None) -> ForwardBatch:
    """Orders chunks rowwise-first (in place) and packs them. Those rows are the bulk at
    large batch sizes, so their slots and tables are computed in plain Python ints and
    turned into tensors once; extend chunks use tensor ops per chunk.
    hybrid: a V4 engine's HybridBatcher (called as hybrid(chunks, T, pad)), None for MLA.
    pad: one-token chunks only, padded to pad.rows rows of fixed shapes."""
    if hybrid is not None:
        chunks.sort(key=hybrid.rowwise_order)
        return _to(_hybrid_batch(chunks, hybrid, pad), device)
    chunks.sort(key=_extends_last)
    ids: list[int] = []
    dec_pos: list[int] = []
    dec_slots: list[int] = []
    decode_tables: list[list[int]] = []
    table_lens: list[int] = []
    ext_pos: list[torch.Tensor] = []
    ext_slots: list[torch.Tensor] = []
    extends: list[ExtendSeq] = []
    bs = block_size
    num_decode = 0
    for c in chunks:
        c.row = len(ids)
        n = len(c.token_ids)
        ids += c.token_ids
        blocks = c.seq.block_ids
        p = c.start
        if n == 1:
            num_decode += 1
            dec_pos.append(p)
            nb = p // bs + 1
            dec_slots.append(blocks[nb - 1] * bs + p % bs)
            decode_tables.append(blocks)
            table_lens.append(nb)
            continue
        if n <= ROWWISE_MAX:
            for q in range(p, p + n):
                nb = q // bs + 1
                dec_pos.append(q)
                dec_slots.append(blocks[nb - 1] * bs + q % bs)
                decode_tables.append(blocks)
                table_lens.append(nb)
            continue
        bt = torch.tensor(blocks, dtype=torch.long)
        ctx = torch.arange(p + n)
        ctx_slots = bt[ctx // bs] * bs + ctx % bs
        ext_pos.append(ctx[p:])
        ext_slots.append(ctx_slots[p:])
        extends.append(ExtendSeq(c.row, n, p + n, ctx_slots))
    if pad is not None:  # token 0 at position 0 of the scratch block, attending to itself
        extra = pad.rows - len(ids)
        ids += [0] * extra
        dec_pos += [0] * extra
        dec_slots += [pad.block * bs] * extra
        decode_tables += [[pad.block]] * extra
        table_lens += [1] * extra
    positions = torch.tensor(dec_pos, dtype=torch.long)
    slots = torch.tensor(dec_slots, dtype=torch.long)
    if ext_pos:
        positions = torch.cat([positions, *ext_pos])
        slots = torch.cat([slots, *ext_slots])
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=positions,
        slot_mapping=slots,
        num_decode=num_decode,
        num_rowwise=len(dec_pos),
        extends=extends,
    )
    if dec_pos:
        width = -(-pad.max_len // bs) if pad is not None else max(table_lens)
        batch.decode_block_tables = _block_table(decode_tables, table_lens, width)
        batch.decode_context_lens = torch.tensor(dec_pos) + 1
    batch.static = pad is not None
    return _to(batch, device)


def _hybrid_batch(chunks: list[Chunk], hybrid, pad: Padding | None) -> ForwardBatch:
    """DeepSeek-V4 reads its cache through the batch's HybridMeta alone: no latent slots
    or block tables, and each row's position is the one its ring write uses."""
    ids: list[int] = []
    for c in chunks:
        c.row = len(ids)
        ids += c.token_ids
    num_decode = sum(1 for c in chunks if len(c.token_ids) == 1)  # decode rows, for the step's stats
    if pad is not None:
        ids += [0] * (pad.rows - len(ids))
    meta = hybrid(chunks, len(ids), pad)
    return ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.long), positions=meta.write_pos,
                        slot_mapping=_NO_SLOTS, num_decode=num_decode, hybrid=meta, static=pad is not None)


_NO_SLOTS = torch.zeros(0, dtype=torch.long)


def _extends_last(c: Chunk) -> bool:
    return len(c.token_ids) > ROWWISE_MAX


def _block_table(tables: list[list[int]], lens: list[int], width: int) -> torch.Tensor:
    """[rows, width]: each row's first lens[r] block ids, zero-padded. Built in one
    flat int64 buffer: a tensor made from nested lists costs 4x as much at batch 256."""
    pad = [0] * width
    flat = array("q")
    for blocks, n in zip(tables, lens):
        flat.extend(blocks if len(blocks) == n else blocks[:n])
        if n < width:
            flat.extend(pad[: width - n])
    return torch.frombuffer(flat, dtype=torch.int64).view(len(lens), width)


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
    return pack(batch, lambda flat: flat.pin_memory().to(device, non_blocking=True))


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
