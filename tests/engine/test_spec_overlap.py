"""MTP steps planned while the step before is in flight (shared/engine/spec_overlap.py)
give exactly what whole MTP steps give, and leave no block behind: drafts rejected at
random, stops the plan could not foresee, aborts while a step is in flight, requests
that join mid-flight, sequences near their end, seeded sampling, and a cache small
enough to force preemption (whose recomputed prompts run whole)."""

from hypothesis import given, settings, strategies as st

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.mock_model import MockModel
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.protocol.messages import SamplingParams
from tests.engine.step_drivers import drive_overlapped as run_overlapped, run_whole


def _engine(tiny_model, overlap=True, accept=0.7, **kw) -> LLMEngine:
    cfg = EngineConfig(model=tiny_model, **{"num_kv_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                                            "num_speculative_tokens": 1, "overlap_mtp": overlap, **kw})
    return LLMEngine(cfg, model=MockModel(ModelConfig.from_dir(tiny_model), 0.0, accept))


request_st = st.fixed_dictionaries({
    "prompt_len": st.integers(1, 40),
    "max_tokens": st.integers(1, 30),
    "seed": st.one_of(st.none(), st.integers(0, 1000)),
    "stop_pos": st.one_of(st.none(), st.integers(0, 40)),  # a stop id the mock will emit at this position
    "join_at": st.integers(0, 12),
    "abort_at": st.one_of(st.none(), st.integers(0, 30)),
    "logprobs": st.booleans(),
})


@settings(max_examples=40, deadline=None)
@given(reqs=st.lists(request_st, min_size=1, max_size=10), blocks=st.sampled_from([24, 40, 256]),
       accept=st.sampled_from([0.0, 0.7, 1.0]))
def test_overlapped_mtp_steps_equal_whole_steps(tiny_model, reqs, blocks, accept):
    probe = _engine(tiny_model)
    vocab = probe.model_config.vocab_size

    def token_at(pos: int) -> int:  # the target's token at a position (the mock's)
        return int(4 + (pos * 2654435761 + 12345) % (vocab - 4))

    def params(r) -> SamplingParams:
        stops = (token_at(r["prompt_len"] + r["stop_pos"]),) if r["stop_pos"] is not None else ()
        return SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, stop_token_ids=stops,
                              temperature=1.0 if r["seed"] is not None else 0.0, seed=r["seed"],
                              logprobs=1 if r["logprobs"] else None)

    def prompt(i, r):
        return [5 + (i * 7 + j) % 50 for j in range(r["prompt_len"])]

    ref_eng = _engine(tiny_model, overlap=False, accept=accept)
    assert not ref_eng.can_overlap
    for i, r in enumerate(reqs):
        ref_eng.add_request(f"r{i}", prompt(i, r), params(r))
    ref = run_whole(ref_eng)

    eng = _engine(tiny_model, accept=accept, num_kv_blocks=blocks)
    assert eng.overlap_mtp
    actions: dict[int, list] = {}
    for i, r in enumerate(reqs):
        if eng.blocks.blocks_for(r["prompt_len"] + r["max_tokens"] + 1) > blocks:
            continue
        actions.setdefault(r["join_at"], []).append(
            lambda e, i=i, r=r: e.add_request(f"r{i}", prompt(i, r), params(r)))
        if r["abort_at"] is not None:
            actions.setdefault(r["join_at"] + r["abort_at"], []).append(lambda e, i=i: e.abort(f"r{i}"))
    got, _ = run_overlapped(eng, actions)

    for i, r in enumerate(reqs):
        rid = f"r{i}"
        if rid not in got:
            continue  # aborted before its first token, or too big for the cache
        want = ref[rid]
        if got[rid]["reason"] is None:  # aborted: what it got is what it would have got
            assert r["abort_at"] is not None and got[rid]["ids"] == want["ids"][: len(got[rid]["ids"])], rid
        else:
            assert got[rid] == want, rid
    assert not eng.has_unfinished()
    eng.blocks.check()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_decode_steps_are_planned_while_the_step_before_runs(tiny_model):
    """Most steps of a decode batch go the overlapped way, the drafts' acceptance at the
    mock's rate, each sequence to its full length."""
    eng = _engine(tiny_model)
    for i in range(6):
        eng.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    got, overlapped = run_overlapped(eng, {})
    assert all(len(got[f"r{i}"]["ids"]) == 40 for i in range(6))
    assert overlapped > 15
    assert 0.5 < eng.num_accepted_total / eng.num_drafted_total < 0.9


def test_the_real_model_overlapped_matches_whole_steps(tiny_engine_factory):
    """The real forward (its drafts are rejected: a random model), greedy and seeded."""
    prompts = [[0, 5, 6, 7] * (i + 1) for i in range(4)]

    def go(overlap):
        eng = tiny_engine_factory(num_speculative_tokens=1, overlap_mtp=overlap)
        for i, pr in enumerate(prompts):
            eng.add_request(f"r{i}", pr, SamplingParams(max_tokens=10, temperature=0 if i % 2 else 1.0,
                                                         seed=i if i % 2 == 0 else None, ignore_eos=True))
        return run_overlapped(eng, {})[0] if overlap else run_whole(eng)

    assert go(True) == go(False)
