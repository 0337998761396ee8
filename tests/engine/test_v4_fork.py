"""Parallel sampling on a DeepSeek-V4 engine (engine/fork.py): the prompt computed once,
n children that share its full blocks, copy its partial last block on first write, and
each start from a copy of its ring; every child samples what the single request does.

v4-tiny: window 8, CSA groups of 4, HCA groups of 16, block size 16, look-back 15.
"""

from __future__ import annotations

import pytest
import torch

from moemesh.shared.engine import fork_io
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.kv.spec import describe
from moemesh.shared.protocol.forks import fork_ids, fork_params
from moemesh.shared.protocol.messages import SamplingParams
from tests.engine.test_fork import _forks
from tests.engine.step_drivers import run_overlapped, run_whole

# 40 tokens: two full blocks and a tail of 7 positions; the children's position 39 ends a
# CSA group, whose entry goes into the tail block's main row (each child's own copy).
PROMPT = [0] + [(i * 53 + 7) % 900 + 5 for i in range(39)]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def v4(tiny_v4_engine_factory):
    def make(**kw) -> LLMEngine:
        kw.setdefault("num_kv_blocks", 64)
        return tiny_v4_engine_factory(**kw)

    return make


def _solo(make, p: SamplingParams, prompt=PROMPT, **kw) -> list[int]:
    eng = make(**kw)
    eng.add_request("solo", prompt, p)
    return run_whole(eng)["solo"]["ids"]


def _idle(eng: LLMEngine) -> None:
    """Everything is back: blocks, rings, snapshot rings."""
    eng.blocks.check()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert eng.blocks.num_free_rings == eng.blocks.num_rings
    assert not eng.seqs and not eng.held and not eng._parent_of
    if eng.snapshots is not None:
        eng.snapshots.check()
        assert not eng.snapshots._pinned


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
def test_children_share_the_full_blocks_copy_the_tail_and_the_ring_and_free_everything(v4, spec):
    eng = v4(num_speculative_tokens=spec, max_num_batched_tokens=16)  # the parent in chunks
    rings = eng.blocks.num_free_rings
    eng.add_request("r", PROMPT, GREEDY, forks=_forks("r", 3, GREEDY))
    computed = 0
    while "r" in eng.seqs:  # the parent computes the prompt but its last position, then forks
        eng.step()
        assert set(fork_ids("r", 3)) <= set(eng.last_stats.scheduled)
        computed += eng.last_stats.num_tokens
        if "r" in eng.seqs:  # from its admission it holds a ring for each child
            assert eng.blocks.num_free_rings == rings - 3 and len(eng.seqs["r"].fork_rings) == 2
    assert computed == len(PROMPT) - 1
    kids = [eng.seqs[c] for c in fork_ids("r", 3)]
    assert len({k.ring for k in kids}) == 3 and eng.blocks.num_free_rings == rings - 3
    for k in kids[1:]:  # each ring holds the parent's state, copied once its last chunk had run
        assert torch.equal(eng.kv.rings[k.ring], eng.kv.rings[kids[0].ring])
    full, tail = kids[0].block_ids[:2], kids[0].block_ids[2]
    assert all(k.block_ids[:2] == full for k in kids) and all(eng.blocks.ref_count(b) == 3 for b in full)
    assert [k.cow_src for k in kids] == [-1, tail, tail] and eng.blocks.ref_count(tail) == 3
    before = eng.kv.main[tail].clone()
    eng.step()  # each child computes position P-1 into a tail of its own, and samples
    assert eng.last_stats.num_tokens == 3
    tails = [k.block_ids[2] for k in kids]
    assert len(set(tails)) == 3 and eng.blocks.ref_count(tail) == 1
    assert all(k.cow_src == -1 and k.num_output_tokens == 1 for k in kids)
    assert not torch.equal(eng.kv.main[tail], before)  # the group ending at P-1 was filed ...
    for t in tails[1:]:  # ... into each copy alike
        torch.testing.assert_close(eng.kv.main[t], eng.kv.main[tail])
    rest = run_whole(eng)
    assert set(rest) == set(fork_ids("r", 3)) and all(r["reason"] == "length" for r in rest.values())
    assert eng.num_prompt_tokens_total == len(PROMPT)  # counted once, not per child
    _idle(eng)


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
# no parent; the parent computes one position; no tail (P-1 on a block boundary); a tail
# inside a CSA group; a tail whose group the children complete; past many windows
@pytest.mark.parametrize("prompt_len", [1, 2, 17, 21, 40, 70])
def test_greedy_children_equal_the_single_request(v4, spec, prompt_len):
    prompt = (PROMPT * 2)[:prompt_len]
    want = _solo(v4, GREEDY, prompt, num_speculative_tokens=spec)
    eng = v4(num_speculative_tokens=spec)
    eng.add_request("r", prompt, GREEDY, forks=_forks("r", 4, GREEDY))
    computed = 0
    while "r" in eng.seqs:
        eng.step()
        computed += eng.last_stats.num_tokens
    assert computed == max(prompt_len - 1, 0)  # the prompt once (but its last position)
    got = run_whole(eng)
    assert {c: got[c]["ids"] for c in fork_ids("r", 4)} == {c: want for c in fork_ids("r", 4)}
    _idle(eng)


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
def test_seeded_children_are_each_the_single_request_with_their_seed(v4, spec):
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    eng = v4(num_speculative_tokens=spec)
    eng.add_request("r", PROMPT, p, forks=_forks("r", 3, p))
    eng.add_request("other", [0, 9, 9, 9], SamplingParams(max_tokens=5, temperature=1.0))  # batched with them
    got = run_whole(eng)
    kids = [got[c]["ids"] for c in fork_ids("r", 3)]
    assert kids == [_solo(v4, fork_params(p, i), num_speculative_tokens=spec) for i in range(3)]
    assert len({tuple(k) for k in kids}) == 3
    _idle(eng)


def test_overlapped_steps_fork_the_same_as_whole_steps(v4):
    """The serving loop plans the children's first step while the parent's last chunk is
    in flight: their rings are copied after that chunk's forward, their tails before
    their own, and the outputs are the whole-step ones."""
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    ref_eng = v4(num_speculative_tokens=0)
    ref_eng.add_request("r", PROMPT, p, forks=_forks("r", 3, p))
    ref = run_whole(ref_eng)
    eng = v4(num_speculative_tokens=0, max_num_batched_tokens=8)  # the prompt in chunks
    got = run_overlapped(eng, {0: [lambda e: e.add_request("r", PROMPT, p, forks=_forks("r", 3, p))]})
    assert got == ref
    _idle(eng)


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
def test_aborts_free_every_child_and_ring(v4, spec):
    # No prefix cache: each parent computes the whole prompt, in chunks.
    eng = v4(num_speculative_tokens=spec, max_num_batched_tokens=16, enable_prefix_caching=False)
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    # Before the parent runs: aborting one child leaves the others; aborting the last ends it.
    eng.add_request("a", PROMPT, p, forks=_forks("a", 3, p))
    assert eng.abort("a-1")
    got = run_whole(eng)
    assert set(got) == {"a-0", "a-2"}
    eng.add_request("b", PROMPT, p, forks=_forks("b", 2, p))
    assert eng.abort("b-0") and eng.abort("b-1") and not eng.has_unfinished()
    # While the parent runs: the ring it holds for the aborted child goes back at the fork.
    eng.add_request("e", PROMPT, p, forks=_forks("e", 3, p))
    eng.step()
    assert len(eng.seqs["e"].fork_rings) == 2 and eng.abort("e-1")
    got = run_whole(eng)
    assert set(got) == {"e-0", "e-2"}
    _idle(eng)
    # After the fork: mid-decode, and the first step of a child that still holds its copy source.
    eng.add_request("c", PROMPT, p, forks=_forks("c", 3, p))
    while "c" in eng.seqs:
        eng.step()
    assert eng.seqs["c-2"].cow_src >= 0
    assert eng.abort("c-2")
    eng.step()
    eng.step()
    assert eng.abort("c-0") and eng.abort("c-1") and not eng.has_unfinished()
    # The parent by its own id takes its children with it.
    eng.add_request("d", PROMPT, p, forks=_forks("d", 2, p))
    eng.step()
    assert eng.abort("d") and not eng.abort("d-0") and not eng.has_unfinished()
    _idle(eng)


@pytest.mark.parametrize("chunk", [16, 64])
def test_the_serving_loop_keeps_the_parents_boundary_snapshot(v4, chunk):
    """As the serving loop runs: the parent's last chunk (and its fork) is planned before
    the chunk that ends on a block boundary lands. That chunk's blocks are then registered
    by child 0, so the boundary's snapshot is kept and a second request starts from it."""
    prompt = PROMPT[:34]
    want = _solo(v4, GREEDY, prompt)
    eng = v4(num_speculative_tokens=0, max_num_batched_tokens=chunk)
    for rid in ("a", "b"):
        before = eng.num_cached_tokens_total
        eng.add_request(rid, prompt, GREEDY, forks=_forks(rid, 3, GREEDY))
        got = run_overlapped(eng, {})
        assert [got[c]["ids"] for c in fork_ids(rid, 3)] == [want] * 3
        assert eng.num_cached_tokens_total - before == (0 if rid == "a" else 32)
    _idle(eng)


def test_a_forked_prompt_is_reused_from_the_prefix_cache(v4):
    """A second request of n > 1 on the same prompt starts its parent on the cached blocks
    and the boundary snapshot the first one's parent took, computes what is left of the
    prompt but its last position, and forks: the same outputs."""
    prompt = PROMPT[:34]  # the parent's last position, 32, starts a block: a snapshot at 32
    want = _solo(v4, GREEDY, prompt)
    eng = v4()
    outs = []
    for rid in ("a", "b"):
        eng.add_request(rid, prompt, GREEDY, forks=_forks(rid, 3, GREEDY))
        computed = 0
        while rid in eng.seqs:
            eng.step()
            computed += eng.last_stats.num_tokens
        outs.append((computed, run_whole(eng)))
    (cold, first), (warm, second) = outs
    assert (cold, warm) == (33, 1)
    assert [first[c]["ids"] for c in fork_ids("a", 3)] == [second[c]["ids"] for c in fork_ids("b", 3)] == [want] * 3
    assert eng.num_cached_tokens_total == 32  # counted once for the three children
    _idle(eng)


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
def test_children_move_to_decode_as_one_buffer(v4, spec):
    """engine/fork_io.py on V4: the shared blocks' main rows once, each child's last block,
    then each child's ring look-back; the decode engine files the shared blocks once (a
    reference per child) and each look-back into a ring of the child's, and goes on as
    the offline engine does. A child aborted on the way is left out."""
    want = _solo(v4, GREEDY, num_speculative_tokens=spec)
    pre = v4(role="prefill", num_speculative_tokens=spec)
    pre.add_request("r", PROMPT, GREEDY, forks=_forks("r", 3, GREEDY))
    firsts = {k: v["ids"] for k, v in run_whole(pre).items()}
    kids = fork_ids("r", 3)
    assert set(pre.held) == set(kids) and pre.num_prompt_tokens_total == len(PROMPT)
    buf = fork_io.export(pre, kids)
    drafts = {c: pre.held_drafts(c) for c in kids}
    s = fork_io.num_shared(len(PROMPT), pre.cfg.block_size)
    spec_ = describe(pre)
    assert tuple(buf.shape) == fork_io.shape(pre, len(PROMPT), 3) == spec_.shape(s + 3, 3)
    assert buf.numel() * buf.element_size() == spec_.nbytes(s + 3, 3) < 3 * spec_.nbytes(s + 1)
    mw, cw = pre.kv.layout.main_width, pre.kv.layout.carry_width
    mains, carries = buf[: (s + 3) * mw].view(s + 3, mw), buf[(s + 3) * mw :].view(3, cw)
    for i, cid in enumerate(kids):  # each child's own export: the shared rows, its last block, its carry
        own = torch.cat([mains[list(range(s)) + [s + i]].flatten(), carries[i]])
        torch.testing.assert_close(pre.export_kv(cid), own, rtol=0, atol=0)
        pre.release(cid)
    _idle(pre)

    dec = v4(role="decode", num_speculative_tokens=spec)
    members = [(c, PROMPT + firsts[c], GREEDY, drafts[c]) for c in kids]
    assert fork_io.can_import(dec, len(PROMPT), 2)
    fork_io.add(dec, members, len(PROMPT), buf, skip={"r-1"})
    a, c = dec.seqs["r-0"], dec.seqs["r-2"]
    assert "r-1" not in dec.seqs and a.block_ids[:s] == c.block_ids[:s] and a.block_ids[s] != c.block_ids[s]
    assert dec.blocks.ref_count(a.block_ids[0]) == 2 and a.ring != c.ring >= 0
    assert dec.blocks.num_free_rings == dec.blocks.num_rings - 2
    got = run_whole(dec)
    assert firsts["r-0"] + got["r-0"]["ids"] == want and firsts["r-2"] + got["r-2"]["ids"] == want
    _idle(dec)


def test_a_buffer_of_the_wrong_size_or_too_few_rings_is_refused_and_nothing_leaks(v4):
    from moemesh.shared.engine.engine import NoCapacity, RequestError

    dec = v4(role="decode", num_speculative_tokens=0, max_num_seqs=1)  # two rings
    members = [(c, PROMPT + [7], GREEDY, []) for c in fork_ids("r", 3)]
    good = torch.zeros(fork_io.shape(dec, len(PROMPT), 3), dtype=dec.kv_dtype)
    with pytest.raises(RequestError, match="shape"):
        fork_io.add(dec, members, len(PROMPT), good[:-1])
    assert not fork_io.can_import(dec, len(PROMPT), 3) and fork_io.can_import(dec, len(PROMPT), 2)
    with pytest.raises(NoCapacity):
        fork_io.add(dec, members, len(PROMPT), good)
    fork_io.add(dec, members, len(PROMPT), good, skip={"r-0"})
    assert set(dec.seqs) == {"r-1", "r-2"} and dec.blocks.num_free_rings == 0
    for rid in ("r-1", "r-2"):
        dec.abort(rid)
    _idle(dec)


def test_a_child_refused_at_import_takes_its_siblings_and_their_rings_with_it(v4, tiny_model):
    import json

    from moemesh.shared.engine.engine import RequestError
    from moemesh.shared.protocol.messages import GrammarSpec
    from moemesh.shared.tokenizer.tokenizer import Tokenizer

    dec = v4(role="decode", num_speculative_tokens=0)
    buf = torch.zeros(fork_io.shape(dec, len(PROMPT), 3), dtype=dec.kv_dtype)
    strict = SamplingParams(max_tokens=6, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(
        {"type": "object"})))
    bad = Tokenizer(tiny_model).encode("x", add_special_tokens=False)[:1]  # no JSON starts with x
    kids = fork_ids("r", 3)
    members = [(c, PROMPT + [7], GREEDY, []) for c in kids[:2]] + [(kids[2], PROMPT + bad, strict, [])]
    with pytest.raises(RequestError, match="response_format"):
        fork_io.add(dec, members, len(PROMPT), buf)
    _idle(dec)
