"""MTP drafts across the prefill -> decode hand-off. Offline, the step that samples a
prompt's first token also drafts the next one from the last prompt position's hidden
state, and the first decode step verifies that draft. Through a hand-off the prefill
engine proposes the same drafts (held_drafts), they travel with the KV, and the decode
engine's first step verifies them: the decode steps are the offline ones, step for step.

One request per run, so that offline and hand-off run the same batches: their drafts
and acceptances are then the same computations, whatever the (random) weights accept.
"""

from __future__ import annotations

import pytest

from moemesh.shared.engine.engine import RequestError
from moemesh.shared.protocol.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompt(n: int) -> list[int]:
    return [(i * 53 + n * 7) % 900 + 5 for i in range(n)]


def _steps(eng) -> list[tuple[list[int], int, int]]:
    """Run to the end: per step that emitted, (new ids, drafts verified, drafts accepted)."""
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            out.append((o.new_token_ids, eng.last_stats.num_drafted, eng.last_stats.num_accepted))
    return out


def _offline(make, prompt, k):
    """(first token, drafts proposed with it, the decode steps after it)."""
    eng = make(num_speculative_tokens=k)
    eng.add_request("r", prompt, GREEDY)
    while not eng.seqs["r"].num_output_tokens:
        eng.step()
    eng.drafter.resolve()  # drafts stay on the device until the step that verifies them
    first, drafts = eng.seqs["r"].output_ids, list(eng.seqs["r"].draft_ids)
    return first, drafts, _steps(eng)


def _prefill(make, prompt, k):
    pre = make(role="prefill", num_speculative_tokens=k)
    pre.add_request("r", prompt, GREEDY)
    first = []
    while pre.has_unfinished():
        for o in pre.step():
            first += o.new_token_ids
    return pre, first


def _handoff(make, prompt, k_pre, k_dec):
    """(drafts handed off, the decode engine's steps, the decode engine)."""
    pre, first = _prefill(make, prompt, k_pre)
    drafts = pre.held_drafts("r")
    dec = make(role="decode", num_speculative_tokens=k_dec)
    dec.add_prefilled("r", prompt + first, len(prompt), GREEDY, pre.export_kv("r"), drafts)
    pre.release("r")
    return first, drafts, _steps(dec), dec


@pytest.fixture(scope="module")
def v4_factory(tiny_v4_model):
    from moemesh.shared.checkpoint.loader import load_model
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine

    model = load_model(tiny_v4_model)
    return lambda **kw: LLMEngine(EngineConfig(model=tiny_v4_model, num_kv_blocks=64, **kw), model=model)


def _check_matches_offline(make, prompt, k):
    first, want_drafts, want = _offline(make, prompt, k)
    got_first, drafts, got, dec = _handoff(make, prompt, k, k)
    assert len(want_drafts) == k
    assert got_first == first and drafts == want_drafts
    # The first decode step verified the handed-off drafts, as offline ...
    assert got[0][1] == k
    # ... and every step after it is the offline one: same tokens, same drafts verified
    # and accepted.
    assert got == want
    assert sum(len(ids) for ids, _, _ in got) == GREEDY.max_tokens - 1
    assert dec.blocks.num_free_blocks == dec.blocks.num_blocks


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("n", [7, 16, 23])  # inside a block, a whole block, past one
def test_v3_first_decode_step_verifies_the_prefill_draft(tiny_engine_factory, n, k):
    _check_matches_offline(tiny_engine_factory, _prompt(n), k)


@pytest.mark.parametrize("n", [17, 23, 33])  # past a block; inside a CSA group; past the window
def test_v4_first_decode_step_verifies_the_prefill_draft(v4_factory, n):
    _check_matches_offline(v4_factory, _prompt(n), 1)


@pytest.mark.parametrize("k_pre, k_dec", [(2, 1), (1, 0)])
def test_a_decode_engine_takes_only_the_drafts_it_verifies(tiny_engine_factory, k_pre, k_dec):
    prompt = _prompt(23)
    first, _, want = _offline(tiny_engine_factory, prompt, k_dec)
    got_first, drafts, got, _ = _handoff(tiny_engine_factory, prompt, k_pre, k_dec)
    assert len(drafts) == k_pre and got_first == first
    assert got[0][1] == k_dec
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want]


def test_no_drafts_past_the_budget_or_outside_the_vocab(tiny_engine_factory):
    prompt = _prompt(23)
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    pre = tiny_engine_factory(role="prefill", num_speculative_tokens=2)
    pre.add_request("r", prompt, p)
    first = [t for o in pre.step() for t in o.new_token_ids]
    # One token left to generate: it is the next step's own, so nothing is drafted for it.
    assert pre.held_drafts("r") == []
    dec = tiny_engine_factory(role="decode", num_speculative_tokens=2)
    kv = pre.export_kv("r")
    with pytest.raises(RequestError, match="draft"):
        dec.add_prefilled("r", prompt + first, len(prompt), p, kv, [dec.model_config.vocab_size])
    dec.add_prefilled("r", prompt + first, len(prompt), p, kv, [5, 6])
    assert dec.seqs["r"].draft_ids == []  # the budget holds no draft either
    steps = _steps(dec)
    assert len(steps) == 1 and steps[0][1] == 0 and dec.blocks.num_free_blocks == dec.blocks.num_blocks
