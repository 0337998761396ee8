"""Planned steps overlapped the way the serving loop overlaps them (step N+1 planned while
N is in flight, N landed after N+1 has run) give exactly what whole steps give, and
leave no block behind: with stops the plan could not foresee, aborts while a step is in
flight, requests that join mid-flight, and a cache small enough to force preemption."""

import pytest
from hypothesis import given, settings, strategies as st

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.mock_model import MockModel
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.shared.model.config import ModelConfig
from tests.engine.step_drivers import run_overlapped, run_whole


def _mock_engine(tiny_model, **kw) -> LLMEngine:
    cfg = EngineConfig(model=tiny_model, **{"num_kv_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                                            **kw})
    return LLMEngine(cfg, model=MockModel(ModelConfig.from_dir(tiny_model), 0.0))


request_st = st.fixed_dictionaries({
    "prompt_len": st.integers(1, 40),
    "max_tokens": st.integers(1, 30),
    "seed": st.one_of(st.none(), st.integers(0, 1000)),
    "stop_pos": st.one_of(st.none(), st.integers(0, 40)),  # a stop id the mock will emit at this position
    "join_at": st.integers(0, 12),
    "abort_at": st.one_of(st.none(), st.integers(0, 30)),
})


@settings(max_examples=40, deadline=None)
@given(reqs=st.lists(request_st, min_size=1, max_size=10), blocks=st.sampled_from([24, 40, 256]))
def test_overlapped_planned_steps_equal_whole_steps(tiny_model, reqs, blocks):
    probe = _mock_engine(tiny_model)
    vocab = probe.model_config.vocab_size

    def token_at(pos: int) -> int:  # what the mock's logits favour at a position
        return int(4 + (pos * 2654435761 + 12345) % (vocab - 4))

    def params(r) -> SamplingParams:
        stops = (token_at(r["prompt_len"] + r["stop_pos"]),) if r["stop_pos"] is not None else ()
        # Seeded rows sample (temperature 1): their draws are keyed by output position, so
        # batching, lookahead and join order must not change them. The rest are greedy.
        return SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, stop_token_ids=stops,
                              temperature=1.0 if r["seed"] is not None else 0.0, seed=r["seed"])

    def prompt(i, r):
        return [5 + (i * 7 + j) % 50 for j in range(r["prompt_len"])]

    # Reference: every request to its end, whole steps, plenty of blocks.
    ref_eng = _mock_engine(tiny_model)
    for i, r in enumerate(reqs):
        ref_eng.add_request(f"r{i}", prompt(i, r), params(r))
    ref = run_whole(ref_eng)

    eng = _mock_engine(tiny_model, num_kv_blocks=blocks)
    actions: dict[int, list] = {}
    for i, r in enumerate(reqs):
        need = eng.blocks.blocks_for(r["prompt_len"] + r["max_tokens"])
        if need > blocks:
            continue
        actions.setdefault(r["join_at"], []).append(
            lambda e, i=i, r=r: e.add_request(f"r{i}", prompt(i, r), params(r)))
        if r["abort_at"] is not None:
            actions.setdefault(r["join_at"] + r["abort_at"], []).append(lambda e, i=i: e.abort(f"r{i}"))
    got = run_overlapped(eng, actions)

    for i, r in enumerate(reqs):
        rid = f"r{i}"
        if rid not in got:
            continue  # aborted before its first token
        want = ref[rid]
        if got[rid]["reason"] is None:  # aborted: what it got is what it would have got
            assert r["abort_at"] is not None and got[rid]["ids"] == want["ids"][: len(got[rid]["ids"])], rid
        else:
            assert got[rid] == want, rid
    assert not eng.has_unfinished()
    eng.blocks.check()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def _reference_and_prefilled(factory, prompts: list[list[int]], p: SamplingParams):
    """One engine's outputs for the prompts (r0, r1, ...), and a prefill engine holding
    their KV with the first token each sampled."""
    ref_eng = factory(num_speculative_tokens=0)
    for i, pr in enumerate(prompts):
        ref_eng.add_request(f"r{i}", pr, p)
    ref = run_whole(ref_eng)
    pre = factory(role="prefill", num_speculative_tokens=0)
    firsts = {}
    for i, pr in enumerate(prompts):
        pre.add_request(f"r{i}", pr, p)
    while pre.has_unfinished():
        for o in pre.step():
            firsts[o.request_id] = o.new_token_ids
    return ref, pre, firsts


@pytest.mark.parametrize("graphs", ["off", "eager"])
def test_overlapped_decode_on_the_real_model_matches_and_imports_mid_flight(tiny_engine_factory, graphs):
    """The real forward, greedy: a prefill engine hands prompts to a decode engine that
    takes them while its own steps are in flight; also on the padded decode path that a
    GPU captures (decode_graphs.py), the batch growing as the imports land."""
    prompts = [[0, 5, 6, 7] * (i + 2) for i in range(5)]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref, pre, firsts = _reference_and_prefilled(tiny_engine_factory, prompts, p)
    dec = tiny_engine_factory(role="decode", num_speculative_tokens=0, decode_graphs=graphs, max_model_len=256)

    def hand_over(i):
        def act(e):
            rid = f"r{i}"
            e.add_prefilled(rid, prompts[i] + firsts[rid], len(prompts[i]), p, pre.export_kv(rid))
            pre.release(rid)
        return act

    got = run_overlapped(dec, {2 * i: [hand_over(i)] for i in range(len(prompts))})
    for i in range(len(prompts)):
        rid = f"r{i}"
        assert firsts[rid] + got[rid]["ids"] == ref[rid]["ids"] and got[rid]["reason"] == "length"
    dec.blocks.check()
    assert dec.blocks.num_free_blocks == dec.blocks.num_blocks


def test_a_block_freed_while_a_step_is_in_flight_is_not_handed_out_until_it_lands(tiny_engine_factory):
    eng = tiny_engine_factory(num_kv_blocks=8, num_speculative_tokens=0)
    eng.add_request("a", [5] * 20, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    plan = eng.plan_step()
    eng.blocks.begin_step(plan.step_id)
    used = set(eng.seqs["a"].block_ids)
    eng.abort("a")  # the step still writes a's blocks
    got = eng.blocks.allocate(eng.blocks.num_free_blocks)
    assert not used & set(got)
    eng.blocks.free(got)
    eng.blocks.end_step(plan.step_id)
    assert eng.blocks.num_free_blocks == 8
    eng.blocks.check()


def test_imported_requests_respect_max_num_seqs(tiny_engine_factory):
    """KV hand-offs enter the running set directly; a step still batches at most
    max_num_seqs of them, and the others wait their turn and finish the same."""
    prompts = [[0, 5, 6, 7] * (i + 2) for i in range(6)]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref, pre, firsts = _reference_and_prefilled(tiny_engine_factory, prompts, p)
    dec = tiny_engine_factory(role="decode", num_speculative_tokens=0, max_num_seqs=2)
    for i, pr in enumerate(prompts):
        dec.add_prefilled(f"r{i}", pr + firsts[f"r{i}"], len(pr), p, pre.export_kv(f"r{i}"))
    out = {f"r{i}": list(firsts[f"r{i}"]) for i in range(len(prompts))}
    widest = 0
    while dec.has_unfinished():
        for o in dec.step():
            out[o.request_id] += o.new_token_ids
        widest = max(widest, dec.last_stats.num_seqs)
    assert widest == 2
    assert out == {rid: r["ids"] for rid, r in ref.items()}
    assert dec.blocks.num_free_blocks == dec.blocks.num_blocks
