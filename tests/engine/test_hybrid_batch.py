"""The V4 batch metadata, built for the whole batch at once, equals the chunk-at-a-time
reference (tests/engine/hybrid_batch_ref.py) field for field, on random batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings, strategies as st

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.engine.hybrid_batch import HybridBatcher
from moemesh.shared.engine.runner import Chunk
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.v4.layout import V4Layout
from tests.engine.hybrid_batch_ref import ReferenceBatcher

CFG = ModelConfig.from_dict(preset_config("v4-tiny"))
BS = 16
SPANS = tuple(r.count for r in V4Layout(CFG, BS, 1).rings)


@dataclass
class _Seq:
    ring: int
    block_ids: list[int]
    table_row: int = -1


@st.composite
def batches(draw):
    n_dec = draw(st.integers(0, 6))
    lens = [1] * n_dec + draw(st.lists(st.integers(1, 40), max_size=3))
    chunks, row, next_block = [], 0, 0
    for i, q in enumerate(lens):
        start = draw(st.integers(0, 150))
        nb = -(-(start + q) // BS) + draw(st.integers(0, 2))  # a sequence may hold more blocks than it uses
        blocks = list(range(next_block, next_block + nb))[::-1]  # not in order: addresses must follow the table
        next_block += nb
        toks = [7] * q
        chunks.append(Chunk(_Seq(ring=10 + i, block_ids=blocks), start, toks, row))
        row += q
    return chunks, row


RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}


def _addresses(e, t: str) -> dict:
    """An Entries' (block, slot) of every entry each row has; the reference lists them
    per entry (padded with zeros), the batcher as block tables the device reads."""
    m = RATES[t]
    if hasattr(e, "blk"):
        blk, slot = e.blk, e.slot
    else:
        blk, slot = e.addresses(BS // m)
        slot = slot.expand_as(blk)
    # A decode row has (p + 1) // m entries, its visible count; an extend chunk (one table
    # row) has as many as its last row sees (for one row the two agree).
    k = e.visible[:, None] if blk.shape[0] > 1 else e.visible.max()
    have = torch.arange(blk.shape[1])[None, :] < k
    return {"visible": e.visible, "count": blk.shape[1], "blk": torch.where(have, blk, -1),
            "slot": torch.where(have, slot, -1)}


def _fields(meta) -> dict:
    out = {k: v for k, v in vars(meta).items() if isinstance(v, (torch.Tensor, int))}
    for t, g in meta.groups.items():
        out |= {f"groups.{t}.{k}": v for k, v in vars(g).items()}
    for t, e in meta.dec_entries.items():
        out |= {f"dec_entries.{t}.{k}": v for k, v in _addresses(e, t).items()}
    for i, x in enumerate(meta.extends):
        out |= {f"ext{i}.{k}": v for k, v in vars(x).items() if k != "entries"}
        for t, e in x.entries.items():
            out |= {f"ext{i}.{t}.{k}": v for k, v in _addresses(e, t).items()}
    return out


@settings(max_examples=150, deadline=None)
@given(batches(), st.booleans())
def test_the_whole_batch_at_once_equals_one_chunk_at_a_time(batch, sliding_only):
    chunks, T = batch
    batcher = HybridBatcher(CFG, BS, SPANS, rowwise_max=1)  # the reference's split
    got = (batcher.sliding() if sliding_only else batcher)(chunks, T)
    want = ReferenceBatcher(CFG, BS)(chunks, T, sliding_only)
    a, b = _fields(got), _fields(want)
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(b[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
    for span in SPANS:  # where a region of each span reads and writes, without asking the device
        keep = (want.write_pos >= want.write_end - span).nonzero().flatten()
        assert torch.equal(got.keep[span], keep)
        assert torch.equal(got.keep_ring[span], want.write_ring[keep])
        assert torch.equal(got.keep_slot[span], want.write_pos[keep] % span)
        assert torch.equal(got.pre_slot[span], want.pre_pos % span)


@settings(max_examples=30, deadline=None)
@given(batches())
def test_a_batch_reaches_the_device_in_one_copy(batch):
    from moemesh.shared.engine.runner import build_batch, index_tensors, pack

    chunks, _ = batch
    want = _fields(build_batch(list(chunks), BS, "cpu", HybridBatcher(CFG, BS, SPANS, rowwise_max=1)).hybrid)
    copies = []
    moved = pack(build_batch(list(chunks), BS, "cpu", HybridBatcher(CFG, BS, SPANS, rowwise_max=1)),
                 lambda flat: copies.append(flat.clone()) or copies[-1])
    assert len(copies) == 1
    for holder, key in index_tensors(moved):  # every index tensor is a view of the one copy
        t = holder[key] if isinstance(holder, (dict, list)) else getattr(holder, key)
        assert t.untyped_storage().data_ptr() == copies[0].untyped_storage().data_ptr()
    got = _fields(moved.hybrid)
    assert got.keys() == want.keys() and all(
        torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k] for k in want)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_short_chunks_are_attended_row_by_row_with_what_each_row_sees(batch):
    """A chunk of a few rows (a decode row and its drafts) goes with the decode rows: each
    row gets the window its shared-keys form would mask in, and the entries it may see."""
    from moemesh.shared.engine.runner import build_batch

    chunks, _ = batch
    short = HybridBatcher(CFG, BS, SPANS)
    b = build_batch(list(chunks), BS, "cpu", short)
    order = sorted(chunks, key=lambda c: c.q_len > short.rowwise_max)  # build_batch's order
    ref = ReferenceBatcher(CFG, BS)(order, b.num_tokens)  # same rows, the reference's split
    meta, W = b.hybrid, CFG.sliding_window
    n_dec = next((i for i, c in enumerate(order) if c.q_len != 1), len(order))  # the reference's decode rows
    rowwise = [c for c in order if c.q_len <= short.rowwise_max]
    assert meta.num_decode == sum(c.q_len for c in rowwise) and not any(e.q_len <= 8 for e in meta.extends)
    assert torch.equal(meta.dec_keys[:n_dec], ref.dec_keys)
    for ext in ref.extends:
        if ext.q_len > short.rowwise_max:
            continue
        for i in range(ext.q_len):
            r = ext.q_start + i
            assert torch.equal(meta.dec_keys[r], ext.key_idx[i : i + W])
            for t, m in RATES.items():
                ent, ref_ent = meta.dec_entries[t], ext.entries[t]
                assert int(ent.visible[r]) == int(ref_ent.visible[i])
                k = int(ref_ent.visible[i])
                blk, slot = ent.addresses(BS // m)
                assert torch.equal(blk[r, :k], ref_ent.blk[0, :k]) and torch.equal(slot[0, :k], ref_ent.slot[0, :k])
