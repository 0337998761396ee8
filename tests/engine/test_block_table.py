"""The block tables a step gathers (engine/block_table.py), and the MLA batch built on
them (runner.build_batch) against a chunk-at-a-time reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.shared.engine.block_table import BlockTables
from moemesh.shared.engine.runner import ROWWISE_MAX, Chunk, Padding, build_batch
from moemesh.shared.protocol.messages import SamplingParams

BS = 4


@dataclass(eq=False)
class _Seq:
    request_id: str
    block_ids: list[int] = field(default_factory=list)
    table_row: int = -1


# ---- the table ------------------------------------------------------------------------------

_op = st.tuples(st.sampled_from(["grow", "replace", "clear", "batch"]), st.integers(0, 7), st.integers(0, 9))


@settings(max_examples=80, deadline=None)
@given(st.lists(_op, max_size=60), st.integers(1, 4))
def test_rows_mirror_the_lists_through_growth_replacement_and_eviction(ops, num_rows):
    """Rows are handed on when their sequence is not in the batch, and the table grows when
    a batch holds more sequences than rows: whatever the history, a batch's rows are exact."""
    seqs = [_Seq(f"s{i}") for i in range(8)]
    tables = BlockTables(num_rows, 2)
    next_block = 1
    for kind, i, n in ops:
        s = seqs[i]
        if kind == "grow":  # the scheduler appends in place
            s.block_ids += list(range(next_block, next_block + n))
            next_block += n
        elif kind == "replace":  # admission, a fork, an import: another list, maybe shorter
            s.block_ids = list(range(next_block, next_block + n % 4))
            next_block += n % 4
        elif kind == "clear":  # a preemption
            s.block_ids = []
        else:
            batch = [seqs[(i + k) % 8] for k in range(n % 8 + 1)]
            tables.check(batch)
            rows = tables.rows(batch).tolist()
            assert len(set(rows)) == len(rows) and tables.pad_row not in rows
    tables.check(seqs)


def test_the_padding_row_stays_last_when_the_table_grows():
    tables = BlockTables(1, 4)
    tables.set_pad(9)
    seqs = [_Seq(f"s{i}", [i + 1, i + 2]) for i in range(5)]
    tables.check(seqs)
    assert tables.ids[tables.pad_row].tolist() == [9, 0, 0, 0]
    assert tables.pad_row == tables.ids.shape[0] - 1


# ---- the MLA batch --------------------------------------------------------------------------

def _reference(chunks: list[Chunk]) -> dict:
    """The batch one chunk at a time: rows of chunks of at most ROWWISE_MAX first."""
    order = [c for c in chunks if c.q_len <= ROWWISE_MAX] + [c for c in chunks if c.q_len > ROWWISE_MAX]
    ids, pos, slots, tables, lens, extends = [], [], [], [], [], []
    ext_pos, ext_slots = [], []
    for c in order:
        row = len(ids)
        ids += c.token_ids
        blocks = c.seq.block_ids
        slot = [blocks[q // BS] * BS + q % BS for q in range(c.start + c.q_len)]
        if c.q_len <= ROWWISE_MAX:
            for q in range(c.start, c.start + c.q_len):
                pos.append(q)
                slots.append(slot[q])
                tables.append(blocks[: q // BS + 1])
                lens.append(q + 1)
        else:
            ext_pos += range(c.start, c.start + c.q_len)
            ext_slots += slot[c.start :]
            extends.append((row, c.q_len, c.start + c.q_len, slot))
    width = max((len(t) for t in tables), default=0)
    return {
        "input_ids": ids, "positions": pos + ext_pos, "slot_mapping": slots + ext_slots,
        "decode_block_tables": [t + [0] * (width - len(t)) for t in tables] if tables else None,
        "decode_context_lens": lens or None,
        "extends": extends, "num_rowwise": len(pos), "num_decode": sum(c.q_len == 1 for c in chunks),
    }


def _got(b) -> dict:
    lst = lambda t: None if t is None else t.tolist()
    return {
        "input_ids": b.input_ids.tolist(), "positions": b.positions.tolist(), "slot_mapping": b.slot_mapping.tolist(),
        "decode_block_tables": lst(b.decode_block_tables), "decode_context_lens": lst(b.decode_context_lens),
        "extends": [(e.q_start, e.q_len, e.ctx_len, e.ctx_slots.tolist()) for e in b.extends],
        "num_rowwise": b.num_rowwise, "num_decode": b.num_decode,
    }


_chunk = st.tuples(st.integers(0, 5), st.integers(0, 40), st.sampled_from([1, 1, 2, ROWWISE_MAX, ROWWISE_MAX + 1, 30]),
                   st.booleans(), st.integers(0, 2))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(_chunk, max_size=6), min_size=1, max_size=4), st.integers(1, 3))
def test_the_batch_equals_one_chunk_at_a_time_on_kept_tables(steps, num_rows):
    """A few batches over one pool of sequences, whose lists grow in place or are replaced
    between them; the table is small, so rows are handed on and grow."""
    seqs = [_Seq(f"s{i}") for i in range(6)]
    tables = BlockTables(num_rows, 1)
    next_block = 100
    for step in steps:
        chunks, seen = [], set()
        for i, start, q, replace, spare in step:
            s = seqs[i]
            if i in seen:
                continue
            seen.add(i)
            need = -(-(start + q) // BS) + spare  # may hold more blocks than it uses
            if replace or len(s.block_ids) > need:
                s.block_ids, grow = [], need
            else:
                grow = need - len(s.block_ids)
            s.block_ids += list(range(next_block, next_block + grow))[::-1]  # addresses follow the table
            next_block += grow
            chunks.append(Chunk(s, start, list(range(7, 7 + q))))
        want = _reference(list(chunks))
        assert _got(build_batch(list(chunks), BS, tables=tables)) == want
        assert _got(build_batch(list(chunks), BS)) == want  # a throwaway table: the same


def test_a_padded_batch_reads_the_scratch_block_past_its_rows():
    seqs = [_Seq("a", [5, 6]), _Seq("b", [7])]
    chunks = [Chunk(seqs[0], 5, [1]), Chunk(seqs[1], 2, [2])]
    b = build_batch(chunks, BS, pad=Padding(rows=4, block=3, ring=-1, max_len=16), tables=BlockTables(2, 2))
    assert b.static and b.num_decode == 2 and b.num_rowwise == 4
    assert b.input_ids.tolist() == [1, 2, 0, 0]
    assert b.positions.tolist() == [5, 2, 0, 0]
    assert b.slot_mapping.tolist() == [6 * BS + 1, 7 * BS + 2, 3 * BS, 3 * BS]
    assert b.decode_block_tables.tolist() == [[5, 6, 0, 0], [7, 0, 0, 0], [3, 0, 0, 0], [3, 0, 0, 0]]
    assert b.decode_context_lens.tolist() == [6, 3, 1, 1]


# ---- the engine's table ---------------------------------------------------------------------

@pytest.mark.parametrize("blocks", [12, 256])
def test_the_engines_rows_stay_exact_through_preemption_forks_and_prefix_reuse(tiny_model, blocks):
    """The mock engine steps the real scheduler: sequences are preempted (12 blocks: 9 times),
    forked, and start on cached prefixes; after every step each running sequence's row
    holds its block ids."""
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.engine.mock_model import MockModel
    from moemesh.shared.model.config import ModelConfig
    from moemesh.shared.protocol.forks import fork_ids, fork_params

    eng = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=blocks, max_num_seqs=3, max_num_batched_tokens=48,
                                 enable_prefix_caching=True, block_size=4),
                    model=MockModel(ModelConfig.from_dir(tiny_model), 0.0))
    prompt = [0] + list(range(5, 30))
    for i in range(6):
        p = SamplingParams(max_tokens=12 + i, temperature=0, ignore_eos=True)
        forks = [(cid, fork_params(p, k)) for k, cid in enumerate(fork_ids(f"f{i}", 2))] if i % 3 == 2 else None
        eng.add_request(f"r{i}", prompt[: 10 + 3 * i], p, forks=forks)
    steps = preempted = 0
    while eng.has_unfinished() and steps < 400:
        eng.step()
        eng.tables.check(eng.scheduler.running)
        steps += 1
        preempted += len(eng.last_stats.preempted)
    assert not eng.has_unfinished() and eng.num_cached_tokens_total > 0
    assert preempted > 0 if blocks == 12 else preempted == 0
