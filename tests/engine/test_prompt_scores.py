"""Prompt logprobs (engine/prompt_scores.py): the prompt's tokens scored in the forward that
computes their KV, the same however the prompt is chunked, stepped, cached or forked.
Their agreement with transformers is in tests/oracle/test_against_transformers.py."""

from __future__ import annotations

import random

import pytest

from moemesh.shared.engine.sampler import LOGPROB_FLOOR
from moemesh.shared.protocol.messages import SamplingParams

PROMPT = [0] + [random.Random(3).randrange(4, 1000) for _ in range(40)]
K = 3


def _scored(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=K, **kw)


def _run(eng, requests: dict) -> dict:
    """request id -> (params, prompt, add_request keywords); returns id -> [outputs]."""
    for rid, (params, prompt, kw) in requests.items():
        eng.add_request(rid, prompt, params, **kw)
    outs: dict = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _first(outs: list):
    """The request's prompt scores: on its first output, and on no other."""
    assert outs[0].prompt_logprobs is not None and outs[0].position == 0
    assert all(o.prompt_logprobs is None for o in outs[1:])
    return outs[0].prompt_logprobs


@pytest.fixture(scope="module")
def reference(tiny_engine_factory):
    """The prompt scored in one chunk, one planned step, nothing cached."""
    eng = tiny_engine_factory(num_speculative_tokens=0, enable_prefix_caching=False)
    return _first(_run(eng, {"r": (_scored(), PROMPT, {})})["r"])


def _close(a, b, tol: float = 1e-4) -> None:
    assert a.num_top == b.num_top and a.num_rows == b.num_rows == len(PROMPT) - 1
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < tol
    assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs)) < tol


def test_the_scores_are_the_prompt_tokens_under_the_models_distribution(reference):
    p = reference
    for i in range(p.num_rows):
        ids, vals = p.top(i)
        assert vals == sorted(vals, reverse=True) and LOGPROB_FLOOR <= p.logprobs[i] <= 0
        # the token scored is PROMPT[i + 1]: ranked first exactly when it is the most likely
        assert (p.ranks[i] == 1) == (ids[0] == PROMPT[i + 1])
        if PROMPT[i + 1] in ids:
            assert p.ranks[i] == ids.index(PROMPT[i + 1]) + 1
            assert abs(vals[p.ranks[i] - 1] - p.logprobs[i]) < 1e-6
        else:
            assert p.ranks[i] > K and p.logprobs[i] <= vals[-1]


@pytest.mark.parametrize("spec, budget", [(0, 8), (0, 1024), (1, 8), (1, 1024)])
def test_chunked_and_whole_steps_score_alike(tiny_engine_factory, reference, spec, budget):
    # spec 1: MTP, whose prompt chunks run as whole steps (speculative.py); 0: planned steps
    eng = tiny_engine_factory(num_speculative_tokens=spec, max_num_batched_tokens=budget)
    outs = _run(eng, {"r": (_scored(), PROMPT, {}), "other": (SamplingParams(max_tokens=3), PROMPT[:20], {})})
    _close(_first(outs["r"]), reference)
    assert all(o.prompt_logprobs is None for o in outs["other"])
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_a_cached_prefix_is_recomputed_to_be_scored(tiny_engine_factory, reference):
    eng = tiny_engine_factory(num_speculative_tokens=0)
    _run(eng, {"warm": (SamplingParams(max_tokens=1), PROMPT, {})})
    outs = _run(eng, {"r": (_scored(), PROMPT, {}), "again": (SamplingParams(max_tokens=1), PROMPT, {})})
    assert outs["again"][0].num_cached_tokens > 0  # the cache holds the prompt ...
    assert outs["r"][0].num_cached_tokens == 0  # ... and the scored request did not start on it
    _close(_first(outs["r"]), reference)


def test_blocks_handed_over_to_a_scored_request_are_given_back(tiny_engine_factory, reference):
    # a prefill worker's pulled prefix (cached_blocks) is not used for a scored prompt
    eng = tiny_engine_factory(num_speculative_tokens=0, enable_prefix_caching=False)
    blocks = eng.blocks.allocate(2)
    outs = _run(eng, {"r": (_scored(), PROMPT, {"cached_blocks": blocks})})
    _close(_first(outs["r"]), reference)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("spec", [0, 1])
def test_every_child_of_a_forked_prompt_takes_the_scores(tiny_engine_factory, reference, spec):
    eng = tiny_engine_factory(num_speculative_tokens=spec, max_num_batched_tokens=16)
    forks = [("r-0", _scored(seed=1)), ("r-1", _scored(seed=2))]
    outs = _run(eng, {"r": (None, PROMPT, {"forks": forks})})
    assert set(outs) == {"r-0", "r-1"}
    for rid in outs:
        _close(_first(outs[rid]), reference)


def test_a_prefill_worker_sends_them_with_the_first_token_and_a_recompute_does_not(tiny_engine_factory,
                                                                                    reference):
    pre = tiny_engine_factory(role="prefill", max_num_batched_tokens=16)
    (out,) = _run(pre, {"r": (_scored(), PROMPT, {})})["r"]
    assert out.prefill_done
    _close(out.prompt_logprobs, reference)
    pre.release("r")
    # a decode worker recomputing the prompt after a failed transfer: the client has them
    dec = tiny_engine_factory(role="decode")
    outs = _run(dec, {"r": (_scored(), PROMPT, {"output_ids": out.new_token_ids})})["r"]
    assert all(o.prompt_logprobs is None for o in outs)


def test_a_one_token_prompt_scores_nothing(tiny_engine_factory):
    eng = tiny_engine_factory(num_speculative_tokens=0)
    p = _first(_run(eng, {"r": (_scored(), [7], {})})["r"])
    assert p.num_rows == 0 and p.num_top == K


def test_the_offline_llm_returns_them(offline, reference):
    (c,) = offline.generate([PROMPT], _scored())
    _close(c.prompt_logprobs, reference)
