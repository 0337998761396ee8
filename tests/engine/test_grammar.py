"""Structured output in the engine: the bitmask, draft checks with rollback, generation
that parses (the tiny random model never writes JSON by itself), the prefill -> decode
hand-off, and steps without a constrained request doing no grammar work."""

from __future__ import annotations

import json

import pytest
import torch

from moemesh.shared.engine.engine import RequestError
from moemesh.shared.engine.grammar import GrammarRuntime
from moemesh.shared.protocol.messages import GrammarSpec, SamplingParams, WireSampling, decode, encode
from moemesh.shared.tokenizer.tokenizer import Tokenizer
from tests.json_check import validate

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                   "size": {"type": "string", "enum": ["small", "large"]}},
    "required": ["name", "ok", "size"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
PROMPT = [(i * 37) % 900 + 20 for i in range(19)]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


@pytest.fixture(scope="module")
def runtime(tiny_model, tok):
    return GrammarRuntime(tiny_model, tok.vocab_size, {tok.eos_token_id})


def _params(seed: int, grammar=SPEC, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 80, "temperature": 1.0, "seed": seed, "grammar": grammar, **kw})


def _run(eng) -> tuple[dict[str, list[int]], dict[str, str]]:
    ids, why = {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                why[o.request_id] = o.finish_reason.value
    return ids, why


def _allowed(runtime, m) -> torch.Tensor:
    logits = torch.zeros(1, runtime.vocab_size)
    runtime.mask(logits, [(0, m)])
    return logits[0].isfinite()


def test_the_mask_touches_only_constrained_rows(runtime, tok):
    m = runtime.matcher(SPEC)
    logits = torch.randn(3, runtime.vocab_size)
    before = logits.clone()
    runtime.mask(logits, [(1, m)])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = logits[1].isfinite().nonzero().flatten().tolist()
    # The object's first token: "{" and nothing that is not a prefix of it.
    assert allowed and all(tok.decode([t]).startswith("{") or "{".startswith(tok.decode([t])) for t in allowed)
    assert tok.eos_token_id not in allowed


def test_drafts_are_checked_and_rejected_ones_rolled_back(runtime, tok):
    # Inside the name's string: two one-letter drafts are valid, a raw newline is not.
    prefix = tok.encode('{"name": "', add_special_tokens=False)
    a, b, newline = (tok.encode(c, add_special_tokens=False)[0] for c in ("a", "b", "\n"))
    m = runtime.matcher(SPEC, prefix)
    drafts = [a, b, newline]
    logits = torch.randn(len(drafts) + 1, runtime.vocab_size)
    # The two valid drafts are consumed to mask the rows after them; the newline's row
    # forbids it, and the row after it is never read.
    n = runtime.mask_drafts(logits, m, drafts)
    assert n == 2
    assert logits[0, a].isfinite() and logits[1, b].isfinite() and not logits[2, newline].isfinite()
    # Verification took the first draft and another token than the second: the consumed
    # second draft is rolled back and the target's token fed instead.
    alt = tok.encode("c", add_special_tokens=False)[0]
    assert logits[1, alt].isfinite()
    runtime.settle(m, n, [a, alt])
    want = runtime.matcher(SPEC, prefix + [a, alt])
    assert torch.equal(_allowed(runtime, m), _allowed(runtime, want))
    # ... which differs from keeping the rejected draft: a 4-letter token still fits the
    # 6-letter name after 2 letters, not after 3
    assert not torch.equal(_allowed(runtime, runtime.matcher(SPEC, prefix + [a, b, alt])), _allowed(runtime, m))


@pytest.mark.parametrize("k", [0, 1])  # planned steps; the whole step with MTP drafts
def test_constrained_output_parses_and_free_output_does_not(tiny_engine_factory, tok, k):
    eng = tiny_engine_factory(num_speculative_tokens=k, num_kv_blocks=128)
    for i in range(3):
        eng.add_request(f"c{i}", PROMPT, _params(i))
    eng.add_request("free", PROMPT, _params(9, grammar=None))
    ids, why = _run(eng)
    for i in range(3):
        assert why[f"c{i}"] == "stop", tok.decode(ids[f"c{i}"])
        validate(tok.decode(ids[f"c{i}"]), SCHEMA)
    with pytest.raises(ValueError):
        json.loads(tok.decode(ids["free"]))
    assert not eng.constrained  # all over: no grammar work is left for later steps


def test_json_object_gives_an_object(tiny_engine_factory, tok):
    eng = tiny_engine_factory(num_speculative_tokens=0, num_kv_blocks=128)
    # Greedy: a random model sampled at any temperature writes strings that run for hundreds
    # of tokens; its constrained argmax closes the object in a few dozen.
    p = _params(3, GrammarSpec("json_object"), max_tokens=120, temperature=0)
    eng.add_request("o", PROMPT, p)
    ids, why = _run(eng)
    text = tok.decode(ids["o"])
    assert why["o"] == "stop", text
    assert isinstance(json.loads(text), dict)


def test_a_step_without_a_constrained_row_carries_no_grammar(tiny_engine_factory):
    eng = tiny_engine_factory(num_speculative_tokens=0, num_kv_blocks=128)
    eng.add_request("free", PROMPT, _params(1, grammar=None))
    plan = eng.plan_step()
    assert plan.grammar is None
    eng.run_step(plan)
    eng.land_step(plan)
    eng.add_request("c", PROMPT, _params(2))
    plan = eng.plan_step()
    c = eng.seqs["c"]
    assert [r for r, _ in plan.grammar.rows] == [c.sample_row] and plan.grammar.rows[0][1] is c.matcher


@pytest.mark.parametrize("k", [0, 1])
def test_the_grammar_state_survives_the_handoff(tiny_engine_factory, tok, k):
    """The prefill engine samples the first token under the grammar; the decode engine
    rebuilds the state from the spec and that token, and the whole output validates."""
    pre = tiny_engine_factory(role="prefill", num_speculative_tokens=k, num_kv_blocks=64)
    p = WireSampling.from_params(_params(5))
    # as the hand-off carries it: the spec in the request's sampling parameters, on the wire
    p = decode(encode(p), WireSampling).to_params()
    assert p.grammar == SPEC
    pre.add_request("r", PROMPT, p)
    first = []
    while pre.has_unfinished():
        for o in pre.step():
            first += o.new_token_ids
    assert len(first) == 1 and tok.decode(first).startswith("{")
    dec = tiny_engine_factory(role="decode", num_speculative_tokens=k, num_kv_blocks=64)
    dec.add_prefilled("r", PROMPT + first, len(PROMPT), p, pre.export_kv("r"), pre.held_drafts("r"))
    pre.release("r")
    ids, why = _run(dec)
    text = tok.decode(first + ids["r"])
    assert why["r"] == "stop", text
    validate(text, SCHEMA)


def test_a_grammar_the_library_refuses_is_a_request_error(tiny_engine_factory):
    eng = tiny_engine_factory(num_speculative_tokens=0, num_kv_blocks=64)
    with pytest.raises(RequestError) as e:
        eng.add_request("bad", PROMPT, _params(1, GrammarSpec("json_schema", '{"type": "nope"}')))
    assert e.value.param == "response_format" and "bad" not in eng.seqs and not eng.constrained


def test_output_that_breaks_the_grammar_is_refused_at_the_handoff(tiny_engine_factory, tok):
    eng = tiny_engine_factory(role="decode", num_speculative_tokens=0, num_kv_blocks=64)
    pre = tiny_engine_factory(role="prefill", num_speculative_tokens=0, num_kv_blocks=64)
    pre.add_request("r", PROMPT, _params(1, grammar=None))
    while pre.has_unfinished():
        pre.step()
    bad = tok.encode("x", add_special_tokens=False)
    with pytest.raises(RequestError):
        eng.add_prefilled("r", PROMPT + bad, len(PROMPT), _params(1), pre.export_kv("r"))
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_each_child_of_a_forked_request_keeps_to_the_grammar(tiny_engine_factory, tok):
    # n > 1: the prompt is computed once, and every child samples under its own grammar state
    from moemesh.shared.protocol.forks import fork_ids, fork_params

    eng = tiny_engine_factory(num_speculative_tokens=0, num_kv_blocks=128)
    p = _params(4)
    eng.add_request("r", PROMPT, p, forks=[(cid, fork_params(p, i)) for i, cid in enumerate(fork_ids("r", 3))])
    ids, why = _run(eng)
    assert sorted(ids) == fork_ids("r", 3)
    for cid in ids:
        assert why[cid] == "stop", tok.decode(ids[cid])
        validate(tok.decode(ids[cid]), SCHEMA)
    assert not eng.live_constrained() and eng.blocks.num_free_blocks == eng.blocks.num_blocks
