"""DeepSeek-V4 prefix reuse is exact: a request that starts on cached blocks and a
boundary snapshot gives the greedy output of a cold run, and nothing leaks.

v4-tiny: window 8, CSA groups of 4 (with the overlap, 8 positions back), HCA groups of
16, block size 16, so look-back 15: every boundary reads back through a whole block.
"""

from __future__ import annotations

import random

import pytest

from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.protocol.messages import SamplingParams

BS = 16


@pytest.fixture(scope="module")
def v4(tiny_v4_engine_factory):
    def make(**kw) -> LLMEngine:
        kw.setdefault("num_kv_blocks", 96)
        return tiny_v4_engine_factory(**kw)

    return make


def _run(eng: LLMEngine, prompts: dict[str, list[int]], max_tokens: int | dict = 6) -> dict[str, list[int]]:
    outs = {}
    for rid, p in prompts.items():
        n = max_tokens[rid] if isinstance(max_tokens, dict) else max_tokens
        eng.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        outs[rid] = []
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    return outs


def _cold(v4, prompts: dict[str, list[int]], max_tokens=6, **kw) -> dict[str, list[int]]:
    out = {}
    for rid, p in prompts.items():  # one at a time: no cache, no batch neighbours
        out |= _run(v4(enable_prefix_caching=False, **kw), {rid: p}, max_tokens)
    return out


def _idle(eng: LLMEngine) -> None:
    """Everything is back: blocks, rings, snapshot rings."""
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert eng.blocks.num_free_rings == eng.blocks.num_rings
    eng.blocks.check()
    eng.snapshots.check()
    assert not eng.snapshots._pinned


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 970) for _ in range(n)]


@pytest.mark.parametrize("num_spec", [0, 1, 2])
def test_shared_prefix_inside_a_group_reuses_the_branch_point(v4, num_spec):
    """A and B share 37 tokens (ending inside a CSA group and inside block 2): B learns
    the branch point at 32, C starts there."""
    rng = random.Random(1)
    common = [0] + _toks(rng, 36)
    prompts = {k: common + _toks(rng, 20 + i) for i, k in enumerate("abc")}
    cold = _cold(v4, prompts, num_speculative_tokens=num_spec)
    eng = v4(num_speculative_tokens=num_spec)
    got = {}
    for k in "abc":
        before = eng.num_cached_tokens_total
        got |= _run(eng, {k: prompts[k]})
        hit = eng.num_cached_tokens_total - before
        assert hit == {"a": 0, "b": 0, "c": 32}[k]  # b: blocks cached but no snapshot at 32 yet
    assert got == cold
    _idle(eng)


@pytest.mark.parametrize("num_spec", [0, 1])
def test_next_turn_continues_from_the_last_boundary_of_the_first(v4, num_spec):
    """Turn 2 = turn 1 + its answer + more: it starts on the snapshot taken where turn 1's
    decode passed its last boundary (prefix longer than the window, ends on a boundary)."""
    rng = random.Random(2)
    p1 = [0] + _toks(rng, 41)
    eng = v4(num_speculative_tokens=num_spec)
    out1 = _run(eng, {"t1": p1}, max_tokens=12)["t1"]  # 42 + 12 tokens: boundaries 16, 32, 48
    p2 = p1 + out1 + _toks(rng, 1)  # its first chunk (48..54) is shorter than the window: it reads 47
    before = eng.num_cached_tokens_total
    drafts = _record_drafts(eng)
    out2 = _run(eng, {"t2": p2}, max_tokens=8)["t2"]
    assert eng.num_cached_tokens_total - before == 48
    cold_eng = v4(enable_prefix_caching=False, num_speculative_tokens=num_spec)
    cold_drafts = _record_drafts(cold_eng)
    cold = _cold(v4, {"t1": p1}, 12, num_speculative_tokens=num_spec) | _run(cold_eng, {"t2": p2}, 8)
    assert {"t1": out1, "t2": out2} == cold
    # Drafts read the MTP layer's window rows: restored from the snapshot, they are the same.
    assert drafts == cold_drafts and (len(drafts) > 0) == (num_spec > 0)
    _idle(eng)


def _record_drafts(eng: LLMEngine) -> list[list[int]]:
    """Every draft the engine proposes, per step (outputs alone cannot show them: the
    target verifies whatever the MTP layer drafts)."""
    seen, propose = [], eng.drafter.propose

    def wrapped(work, hidden):
        propose(work, hidden)
        eng.drafter.resolve()  # read them now; the next step then verifies them as read
        seen.extend(list(c.seq.draft_ids) for c, _ in work if c.seq.draft_ids)

    eng.drafter.propose = wrapped
    return seen


def test_a_repeated_prompt_ending_on_a_boundary_reuses_all_but_its_last_block(v4):
    rng = random.Random(3)
    p = [0] + _toks(rng, 63)  # 64 tokens: one must be computed, so boundary 48
    eng = v4()
    first = _run(eng, {"x": p})
    again = _run(eng, {"y": p})
    assert eng.num_cached_tokens_total == 48
    assert first["x"] == again["y"] == _cold(v4, {"x": p})["x"]
    _idle(eng)


def test_chunked_prefill_is_cut_at_the_boundaries_it_snapshots(v4):
    """Chunks of 24 would run past boundary 32 and 48 by more than the ring keeps; the
    prompt's snapshot boundary (48) is still taken, and a repeat starts there."""
    rng = random.Random(4)
    p = [0] + _toks(rng, 60)
    eng = v4(max_num_batched_tokens=24)
    first = _run(eng, {"x": p})
    assert eng.snapshots.num_cached >= 1
    again = _run(eng, {"y": p})
    assert eng.num_cached_tokens_total == 48
    assert first["x"] == again["y"] == _cold(v4, {"x": p})["x"]
    _idle(eng)


def test_reuse_under_preemption_and_snapshot_eviction(v4):
    """Few blocks and two snapshot rings: sequences are preempted (and restart on their
    own cached prefix) and snapshots are evicted while others are pinned."""
    rng = random.Random(5)
    bases = [[0] + _toks(rng, 40), [0] + _toks(rng, 70)]
    prompts = {f"r{i}": rng.choice(bases) + _toks(rng, rng.randrange(1, 20)) for i in range(8)}
    cold = _cold(v4, prompts, 10)
    eng = v4(num_kv_blocks=14, max_num_seqs=4, num_prefix_snapshots=2)
    got = _run(eng, dict(list(prompts.items())[:2]), 10)
    got |= _run(eng, dict(list(prompts.items())[2:]), 10)
    assert got == cold
    assert eng.num_cached_tokens_total > 0
    _idle(eng)


@pytest.mark.parametrize("seed", range(3))
def test_random_traffic_reuse_equals_cold(v4, seed):
    rng = random.Random(100 + seed)
    num_spec = seed % 3
    bases = [[0] + _toks(rng, rng.randrange(8, 60)) for _ in range(3)]
    prompts, max_tokens = {}, {}
    for i in range(7):
        p = rng.choice(bases) + _toks(rng, rng.randrange(0, 25))
        if i > 2 and rng.random() < 0.5:  # a next turn of an earlier request
            j = rng.randrange(i)
            p = prompts[f"r{j}"] + _toks(rng, rng.randrange(1, 10))
        prompts[f"r{i}"], max_tokens[f"r{i}"] = p, rng.randrange(1, 14)
    eng = v4(num_speculative_tokens=num_spec, num_kv_blocks=40, max_num_batched_tokens=rng.choice([16, 40, 256]),
             num_prefix_snapshots=rng.choice([1, 4, 16]))
    got = {}
    order = list(prompts)
    while order:  # in waves: some concurrent, later ones after earlier ones finished
        k = rng.randrange(1, 4)
        wave, order = order[:k], order[k:]
        got |= _run(eng, {r: prompts[r] for r in wave}, {r: max_tokens[r] for r in wave})
    assert got == _cold(v4, prompts, max_tokens, num_speculative_tokens=num_spec)
    _idle(eng)


@pytest.mark.parametrize("num_spec", [0, 1])
def test_a_snapshot_holds_the_state_a_cold_run_has_at_its_boundary(v4, num_spec):
    """The main rows of the cached blocks plus the snapshot's look-back rows (every layer's,
    the MTP layer's included) equal a cold prefill's state at the boundary, as the P/D
    hand-off buffer would carry them."""
    rng = random.Random(6)
    p1 = [0] + _toks(rng, 41)
    eng = v4(num_speculative_tokens=num_spec)
    out1 = _run(eng, {"t1": p1}, max_tokens=12)["t1"]  # its decode passes 48
    seq = p1 + out1
    from moemesh.shared.protocol.prefix_hash import chain

    hashes = chain(seq, BS, eng.kv_identity, 3)
    blocks = eng.blocks.lookup(hashes)
    assert len(blocks) == 3 and eng.snapshots.usable(hashes) == 3
    warm = eng.kv.export(blocks, eng.snapshots.pin(hashes[-1]), 48)
    eng.snapshots.unpin(hashes[-1])

    cold = v4(enable_prefix_caching=False, num_speculative_tokens=num_spec, role="prefill")
    cold.add_request("c", seq[:48], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while cold.has_unfinished():
        cold.step()
    held = cold.held_sequence("c")
    assert held.num_computed == 48
    want = cold.kv.export(held.block_ids[:3], held.ring, 48)
    assert warm.shape == want.shape
    assert (warm - want).abs().max().item() < 1e-4


def test_a_prefix_moved_to_another_engine_with_its_snapshot_is_reused_exactly(v4):
    """What a block fetch does (shared/engine/block_io.py): the holder serves blocks 1..2
    and the snapshot at their end, the receiver (with block 0 and its snapshot of its own,
    and other draft settings, so rings of another span) files them and starts there."""
    import torch

    from moemesh.shared.engine import block_io
    from moemesh.shared.kv.spec import describe
    from moemesh.shared.protocol.prefix_hash import chain

    rng = random.Random(7)
    p1 = [0] + _toks(rng, 47)  # 48 tokens: the prompt snapshots 32, its decode passes 48
    holder = v4(num_speculative_tokens=1)
    out1 = _run(holder, {"t1": p1}, max_tokens=6)["t1"]
    p2 = p1 + out1 + _toks(rng, 5)
    hashes = chain(p2, BS, holder.kv_identity, 3)
    assert block_io.acquire_exact(holder, hashes[:1]) is None  # block 0 is cached, but no snapshot at 16
    got = block_io.acquire_exact(holder, hashes[1:3])
    assert got is not None
    spec = describe(holder)
    buf = torch.empty(spec.block_shape(2), dtype=spec.dtype)
    sums = block_io.gather(holder, got, buf, hashes[1:3])
    block_io.release_exact(holder, got, hashes[1:3])
    assert len(sums) == 3 and sums == block_io.checksums(buf, spec.block_numel, 2)

    recv = v4(num_speculative_tokens=2)
    _run(recv, {"t0": p1[:20]}, max_tokens=1)  # block 0 and its snapshot (16), computed here
    local = block_io.acquire_prefix(recv, hashes)
    assert len(local) == 1
    new = block_io.allocate(recv, 2)
    block_io.scatter_and_register(recv, new, hashes[1:3], buf, first_block=len(local))
    block_io.release(recv, local + new)  # they stay cached
    before = recv.num_cached_tokens_total
    out2 = _run(recv, {"t2": p2}, max_tokens=6)["t2"]
    assert recv.num_cached_tokens_total - before == 48
    assert out2 == _cold(v4, {"t2": p2}, 6)["t2"]
    _idle(holder)
    _idle(recv)
