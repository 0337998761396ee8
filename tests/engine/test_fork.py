"""Parallel sampling in the engine (engine/fork.py): one prompt computed once, n children
that share its full blocks, copy its partial last block, and sample on their own."""

import pytest
import torch

from moemesh.shared.engine.engine import RequestError
from moemesh.shared.protocol.forks import fork_ids, fork_params, fork_seed
from moemesh.shared.protocol.messages import SamplingParams
from tests.engine.step_drivers import run_overlapped, run_whole

PROMPT = [0] + [5 + i % 40 for i in range(20)]  # 21 tokens: at block size 16, one full block and a tail


def _forks(rid: str, n: int, p: SamplingParams) -> list[tuple[str, SamplingParams]]:
    return [(cid, fork_params(p, i)) for i, cid in enumerate(fork_ids(rid, n))]


def _solo(factory, p: SamplingParams, prompt=PROMPT, **kw) -> list[int]:
    eng = factory(**kw)
    eng.add_request("solo", prompt, p)
    return run_whole(eng)["solo"]["ids"]


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
def test_children_share_the_full_blocks_copy_the_tail_and_free_everything(tiny_engine_factory, spec):
    eng = tiny_engine_factory(num_speculative_tokens=spec)
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eng.add_request("r", PROMPT, p, forks=_forks("r", 3, p))
    computed = 0
    while "r" in eng.seqs:  # the parent computes the prompt but its last position, then forks
        eng.step()
        assert eng.last_stats.num_tokens <= len(PROMPT) - 1 - computed
        assert set(fork_ids("r", 3)) <= set(eng.last_stats.scheduled)  # what a worker's trace sees
        computed += eng.last_stats.num_tokens
    assert computed == len(PROMPT) - 1
    kids = [eng.seqs[c] for c in fork_ids("r", 3)]
    shared = kids[0].block_ids[0]
    assert [k.block_ids[0] for k in kids] == [shared] * 3 and eng.blocks.ref_count(shared) == 3
    tail = kids[0].block_ids[1]
    assert [k.cow_src for k in kids] == [-1, tail, tail] and eng.blocks.ref_count(tail) == 3
    eng.step()  # each child computes position P-1 into a block of its own, and samples
    assert eng.last_stats.num_tokens == 3
    assert len({k.block_ids[1] for k in kids}) == 3 and eng.blocks.ref_count(tail) == 1
    assert all(k.cow_src == -1 and k.num_output_tokens == 1 for k in kids)
    rest = run_whole(eng)
    assert set(rest) == set(fork_ids("r", 3)) and all(r["reason"] == "length" for r in rest.values())
    assert eng.num_prompt_tokens_total == len(PROMPT)  # counted once, not per child
    eng.blocks.check()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.seqs and not eng._parent_of


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
@pytest.mark.parametrize("prompt_len", [1, 17, 21, 40])  # no parent; no tail block; a tail; two full blocks
def test_greedy_children_are_identical_and_equal_the_single_request(tiny_engine_factory, spec, prompt_len):
    prompt = PROMPT * 2
    prompt = prompt[:prompt_len]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = _solo(tiny_engine_factory, p, prompt, num_speculative_tokens=spec)
    eng = tiny_engine_factory(num_speculative_tokens=spec)
    eng.add_request("r", prompt, p, forks=_forks("r", 4, p))
    got = run_whole(eng)
    assert {c: got[c]["ids"] for c in fork_ids("r", 4)} == {c: want for c in fork_ids("r", 4)}
    eng.blocks.check()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
def test_seeded_children_are_each_the_single_request_with_their_seed(tiny_engine_factory, spec):
    """Child i samples what a request of n = 1 with seed fork_seed(seed, i) samples: child 0
    what the same request with n = 1 does, and the children differ from each other."""
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    eng = tiny_engine_factory(num_speculative_tokens=spec)
    eng.add_request("r", PROMPT, p, forks=_forks("r", 3, p))
    eng.add_request("other", [0, 9, 9, 9], SamplingParams(max_tokens=5, temperature=1.0))  # batched with them
    got = run_whole(eng)
    kids = [got[c]["ids"] for c in fork_ids("r", 3)]
    assert kids[0] == _solo(tiny_engine_factory, p, num_speculative_tokens=spec)
    for i in (1, 2):
        solo = _solo(tiny_engine_factory, fork_params(p, i), num_speculative_tokens=spec)
        assert kids[i] == solo and fork_params(p, i).seed == 1234 + i
    assert len({tuple(k) for k in kids}) == 3


def test_fork_seeds_stay_in_int64():
    assert fork_seed(None, 3) is None
    assert fork_seed(2**63 - 1, 1) == -(2**63)
    assert fork_seed(-5, 2) == -3


def test_overlapped_steps_fork_the_same_as_whole_steps(tiny_engine_factory):
    """The serving loop plans the children's first step while the parent's last chunk is
    in flight: their tail copies must follow that chunk, and give the whole-step outputs."""
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    ref_eng = tiny_engine_factory(num_speculative_tokens=0)
    ref_eng.add_request("r", PROMPT, p, forks=_forks("r", 3, p))
    ref = run_whole(ref_eng)
    eng = tiny_engine_factory(num_speculative_tokens=0, max_num_batched_tokens=8)  # the prompt in chunks
    got = run_overlapped(eng, {0: [lambda e: e.add_request("r", PROMPT, p, forks=_forks("r", 3, p))]})
    assert got == ref
    eng.blocks.check()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
def test_aborts_free_every_child(tiny_engine_factory, spec):
    eng = tiny_engine_factory(num_speculative_tokens=spec)
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    # Before the fork: aborting one child leaves the others; aborting the last ends the parent.
    eng.add_request("a", PROMPT, p, forks=_forks("a", 3, p))
    assert eng.abort("a-1")
    got = run_whole(eng)
    assert set(got) == {"a-0", "a-2"}
    eng.add_request("b", PROMPT, p, forks=_forks("b", 2, p))
    assert eng.abort("b-0") and eng.abort("b-1") and not eng.has_unfinished()
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
    assert eng.abort("d") and not eng.abort("d-0") and not eng.has_unfinished()
    eng.blocks.check()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng._parent_of


def test_a_request_of_n_holds_n_places_of_max_num_seqs(tiny_engine_factory):
    eng = tiny_engine_factory(num_speculative_tokens=0, max_num_seqs=4)
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with pytest.raises(RequestError, match="n = 5") as e:
        eng.add_request("big", PROMPT, p, forks=_forks("big", 5, p))
    assert e.value.param == "n" and not eng.has_unfinished()
    eng.add_request("a", PROMPT, p, forks=_forks("a", 3, p))
    eng.add_request("b", PROMPT[:9], p, forks=_forks("b", 2, p))
    widest = 0
    while eng.has_unfinished():
        eng.step()
        widest = max(widest, len(eng.scheduler.running) + sum(len(s.forks) - 1 for s in eng.scheduler.running))
    assert widest <= 4
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_duplicate_ids_are_refused_whole(tiny_engine_factory):
    eng = tiny_engine_factory()
    p = SamplingParams(max_tokens=4)
    eng.add_request("x-1", [1, 2, 3], p)
    with pytest.raises(RequestError, match="duplicate"):
        eng.add_request("x", PROMPT, p, forks=_forks("x", 2, p))
    assert set(eng.seqs) == {"x-1"} and not eng._parent_of


def test_a_prefill_engine_holds_each_child_with_the_prompt_kv(tiny_engine_factory):
    """The prefill role: every child is held after its first token, its export is the
    prompt's KV (shared blocks and its own copy of the tail), and a decode engine that
    imports each goes on exactly as the offline engine does."""
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = _solo(tiny_engine_factory, p, num_speculative_tokens=0)
    pre = tiny_engine_factory(role="prefill", num_speculative_tokens=0)
    pre.add_request("r", PROMPT, p, forks=_forks("r", 3, p))
    firsts = {k: v["ids"] for k, v in run_whole(pre).items()}
    assert set(pre.held) == set(fork_ids("r", 3))
    solo = tiny_engine_factory(role="prefill", num_speculative_tokens=0)
    solo.add_request("s", PROMPT, p)
    run_whole(solo)
    ref_kv = solo.export_kv("s")
    dec = tiny_engine_factory(role="decode", num_speculative_tokens=0)
    for cid in fork_ids("r", 3):
        kv = pre.export_kv(cid)
        torch.testing.assert_close(kv, ref_kv)
        dec.add_prefilled(cid, PROMPT + firsts[cid], len(PROMPT), p, kv)
        pre.release(cid)
    got = run_whole(dec)
    assert all(firsts[c] + got[c]["ids"] == want for c in fork_ids("r", 3))
    assert pre.blocks.num_free_blocks == pre.blocks.num_blocks


@pytest.mark.parametrize("spec", [0, None], ids=["plain", "mtp"])
def test_children_move_to_decode_as_one_buffer(tiny_engine_factory, spec):
    """engine/fork_io.py: the prompt's shared blocks once, then each child's last block;
    the decode engine files the shared blocks once (a reference per child) and goes on
    as the offline engine does. A child aborted on the way is left out."""
    from moemesh.shared.engine import fork_io

    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = _solo(tiny_engine_factory, p, num_speculative_tokens=spec)
    pre = tiny_engine_factory(role="prefill", num_speculative_tokens=spec)
    pre.add_request("r", PROMPT, p, forks=_forks("r", 3, p))
    firsts = {k: v["ids"] for k, v in run_whole(pre).items()}
    kids = fork_ids("r", 3)
    buf = fork_io.export(pre, kids)
    drafts = {c: pre.held_drafts(c) for c in kids}
    s = fork_io.num_shared(len(PROMPT), pre.cfg.block_size)
    assert tuple(buf.shape) == pre.kv_shape(s + 3) == pre.kv_shape(fork_io.num_blocks(len(PROMPT), 3, 16))
    for cid in kids:  # each child's own export is the shared blocks and its last block
        torch.testing.assert_close(pre.export_kv(cid), buf[:, list(range(s)) + [s + kids.index(cid)]])
        pre.release(cid)
    assert pre.blocks.num_free_blocks == pre.blocks.num_blocks

    dec = tiny_engine_factory(role="decode", num_speculative_tokens=spec)
    members = [(c, PROMPT + firsts[c], p, drafts[c]) for c in kids]
    assert fork_io.can_import(dec, len(PROMPT), 2)
    fork_io.add(dec, members, len(PROMPT), buf, skip={"r-1"})
    a, c = dec.seqs["r-0"], dec.seqs["r-2"]
    assert "r-1" not in dec.seqs and a.block_ids[:s] == c.block_ids[:s] and a.block_ids[s] != c.block_ids[s]
    assert dec.blocks.ref_count(a.block_ids[0]) == 2
    got = run_whole(dec)
    assert firsts["r-0"] + got["r-0"]["ids"] == want and firsts["r-2"] + got["r-2"]["ids"] == want
    dec.blocks.check()
    assert dec.blocks.num_free_blocks == dec.blocks.num_blocks



def test_a_child_refused_at_import_takes_its_siblings_with_it(tiny_engine_factory, tiny_model):
    """The decode service fails every child when one is refused (its first token breaks its
    grammar); the children started before it must not go on running unseen."""
    import json

    from moemesh.shared.engine import fork_io
    from moemesh.shared.protocol.messages import GrammarSpec
    from moemesh.shared.tokenizer.tokenizer import Tokenizer

    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    pre = tiny_engine_factory(role="prefill", num_speculative_tokens=0)
    pre.add_request("r", PROMPT, p, forks=_forks("r", 3, p))
    firsts = {k: v["ids"] for k, v in run_whole(pre).items()}
    kids = fork_ids("r", 3)
    buf = fork_io.export(pre, kids)
    strict = SamplingParams(max_tokens=6, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(
        {"type": "object"})))
    bad = Tokenizer(tiny_model).encode("x", add_special_tokens=False)[:1]  # no JSON starts with x
    members = [(c, PROMPT + firsts[c], p, []) for c in kids[:2]] + [(kids[2], PROMPT + bad, strict, [])]
    dec = tiny_engine_factory(role="decode", num_speculative_tokens=0)
    with pytest.raises(RequestError, match="response_format"):
        fork_io.add(dec, members, len(PROMPT), buf)
    assert not dec.seqs and not dec.has_unfinished()
    dec.blocks.check()
    assert dec.blocks.num_free_blocks == dec.blocks.num_blocks
