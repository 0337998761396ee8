"""Greedy generation and per-step logits must equal transformers' DeepSeek models."""

from __future__ import annotations

import pytest
import torch

from moemesh.shared.checkpoint.loader import load_model
from moemesh.shared.engine import sampler as sampler_mod
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.protocol.messages import SamplingParams
from tests.oracle.conftest import NEW_TOKENS, Reference

_models: dict[str, torch.nn.Module] = {}


def _engine(ref: Reference, **kw) -> LLMEngine:
    if ref.model_dir not in _models:
        _models[ref.model_dir] = load_model(ref.model_dir)
    kw.setdefault("num_kv_blocks", 512)
    return LLMEngine(EngineConfig(model=ref.model_dir, **kw), model=_models[ref.model_dir])


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **extra)


def _run(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int]]]]) -> dict[str, list[int]]:
    """Steps the engine, adding requests at the given step numbers; returns outputs."""
    outs: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, prompt in arrivals.get(step, []):
            engine.add_request(rid, prompt, _greedy())
            outs[rid] = []
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
        step += 1
        assert step < 10_000
    return outs


def test_one_at_a_time(ref):
    eng = _engine(ref)  # MTP drafting is on by default when the checkpoint has the layer
    assert eng.num_spec == (1 if eng.model_config.has_mtp else 0)
    for i, p in enumerate(ref.prompts):
        assert _run(eng, {0: [(f"r{i}", p)]})[f"r{i}"] == ref.outputs[i], f"prompt {i} (len {len(p)})"
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("spec", [0, 2])
def test_batched(ref, spec):
    eng = _engine(ref, num_speculative_tokens=spec, max_num_batched_tokens=256)
    outs = _run(eng, {0: [(f"r{i}", p) for i, p in enumerate(ref.prompts)]})
    assert [outs[f"r{i}"] for i in range(len(ref.prompts))] == ref.outputs
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_requests_join_mid_flight_with_chunked_prefill(ref):
    eng = _engine(ref, max_num_batched_tokens=24)  # long prompts are split into chunks
    arrivals = {3 * i: [(f"r{i}", p)] for i, p in enumerate(ref.prompts)}
    outs = _run(eng, arrivals)
    assert [outs[f"r{i}"] for i in range(len(ref.prompts))] == ref.outputs


def test_preemption_keeps_outputs(ref):
    # Few blocks: running requests get preempted and recomputed from their tokens.
    eng = _engine(ref, num_kv_blocks=24, max_num_batched_tokens=128)
    outs = _run(eng, {0: [(f"r{i}", p) for i, p in enumerate(ref.prompts)]})
    assert [outs[f"r{i}"] for i in range(len(ref.prompts))] == ref.outputs
    assert eng.blocks.num_free_blocks == 24


def test_prefill_export_import_decode_on_another_engine(ref):
    pre = _engine(ref, role="prefill")
    dec = _engine(ref, role="decode", num_speculative_tokens=2)
    for i, p in enumerate(ref.prompts):
        pre.add_request(f"r{i}", p, _greedy())
    firsts = {}
    while pre.has_unfinished():
        for o in pre.step():
            assert o.prefill_done and len(o.new_token_ids) == 1
            firsts[o.request_id] = o.new_token_ids
    for i, p in enumerate(ref.prompts):
        rid = f"r{i}"
        kv = pre.export_kv(rid).clone()  # what a transport would carry
        pre.release(rid)
        dec.add_prefilled(rid, p + firsts[rid], len(p), _greedy(), kv)
    assert pre.blocks.num_free_blocks == pre.blocks.num_blocks
    outs = {rid: list(t) for rid, t in firsts.items()}
    while dec.has_unfinished():
        for o in dec.step():
            outs[o.request_id] += o.new_token_ids
    assert [outs[f"r{i}"] for i in range(len(ref.prompts))] == ref.outputs
    assert dec.blocks.num_free_blocks == dec.blocks.num_blocks


def test_every_step_logits_match_within_1e4(ref, monkeypatch):
    """Teacher-forced: the reference's tokens are fed back; every step's logits agree."""
    eng = _engine(ref, num_speculative_tokens=0, max_num_batched_tokens=64)
    ours: dict[str, list[torch.Tensor]] = {}
    real_sample = sampler_mod.sample

    def forced(logits, params, gens):
        toks = real_sample(logits, params, gens)
        for r, p in enumerate(params):
            rid = p.extra["rid"]
            i = int(rid[1:])
            ours.setdefault(rid, []).append(logits[r].clone())
            toks[r] = ref.outputs[i][len(ours[rid]) - 1]
        return toks

    monkeypatch.setattr(sampler_mod, "sample", forced)
    for i, p in enumerate(ref.prompts):
        eng.add_request(f"r{i}", p, _greedy(extra={"rid": f"r{i}"}))
    while eng.has_unfinished():
        eng.step()
    worst = 0.0
    for i in range(len(ref.prompts)):
        got = torch.stack(ours[f"r{i}"])
        expect = ref.logits[i]
        assert got.shape == expect.shape
        worst = max(worst, (got - expect).abs().max().item())
    assert worst < 1e-4, worst


@pytest.mark.parametrize("spec", [0, 1])
def test_prompt_logprobs_match_within_1e4(ref, spec):
    """A prompt's tokens scored in its prefill (engine/prompt_scores.py), chunked, against
    transformers' log-softmax over one forward of the prompt."""
    eng = _engine(ref, num_speculative_tokens=spec, max_num_batched_tokens=24)
    for i, p in enumerate(ref.prompts):
        eng.add_request(f"r{i}", p, _greedy(prompt_logprobs=2))
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
    worst = 0.0
    for i, p in enumerate(ref.prompts):
        lp = torch.log_softmax(ref.prompt_logits[i].float(), dim=-1)
        expect = lp[torch.arange(len(p) - 1), torch.tensor(p[1:])] if len(p) > 1 else torch.zeros(0)
        ours = got[f"r{i}"]
        assert ours.num_rows == len(p) - 1
        worst = max([worst, *(abs(a - b) for a, b in zip(ours.logprobs, expect.tolist()))])
        top = lp.topk(2, dim=-1).values.flatten().tolist() if len(p) > 1 else []
        worst = max([worst, *(abs(a - b) for a, b in zip(ours.top_logprobs, top))])
    assert worst < 1e-4, worst


def test_spec_decode_with_accepted_drafts_is_exact(ref_v3, monkeypatch):
    """Drafts that match the target must be accepted several at a time without changing
    the output. Random MTP weights rarely agree with the target, so the drafts here come
    from the known answer, with a wrong guess mixed in."""
    ref = ref_v3
    eng = _engine(ref, num_speculative_tokens=3)
    real_propose = eng.drafter.propose

    def propose(work, hidden):
        real_propose(work, hidden)  # still fills the MTP cache
        for c, _ in work:
            seq = c.seq
            if seq.draft_ids:
                i = int(seq.request_id[1:])
                n = seq.num_output_tokens
                good = ref.outputs[i][n : n + len(seq.draft_ids)]
                seq.draft_ids = good if n % 3 else good[:1] + [(good[1] + 1) % 1000] if len(good) > 1 else good

    monkeypatch.setattr(eng.drafter, "propose", propose)
    drafted = accepted = 0
    real_step = eng.step

    def step():
        nonlocal drafted, accepted
        out = real_step()
        drafted += eng.last_stats.num_drafted
        accepted += eng.last_stats.num_accepted
        return out

    monkeypatch.setattr(eng, "step", step)
    outs = _run(eng, {0: [(f"r{i}", p) for i, p in enumerate(ref.prompts)]})
    assert [outs[f"r{i}"] for i in range(len(ref.prompts))] == ref.outputs
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    total = NEW_TOKENS * len(ref.prompts)
    assert accepted > total // 3, (accepted, total)  # many tokens arrived as accepted drafts
    assert drafted > accepted  # and the planted wrong guesses were rejected
