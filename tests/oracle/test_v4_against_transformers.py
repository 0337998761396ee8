"""DeepSeek-V4: greedy generation and per-step logits must equal transformers'.

The engine's paths (one at a time, batched, joining mid-flight with chunks that end
inside compression groups, preemption, prefill/decode split, MTP drafts) are each held
to the reference, on the v4-tiny preset and on architectures it does not have.
"""

from __future__ import annotations

import pytest
import torch

from moemesh.shared.checkpoint.loader import load_model
from moemesh.shared.engine import sampler as sampler_mod
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.kv.spec import describe
from moemesh.shared.protocol.messages import SamplingParams
from tests.oracle.conftest import Reference
from tests.oracle.v4_reference import mtp_reference_logits, reference

# Past the window (8) and an HCA group (16), with groups cut by chunks of 13.
LENS = [1, 2, 5, 8, 9, 15, 16, 17, 31, 33, 47, 64, 65, 90, 127]
NEW = 16
_models: dict[str, torch.nn.Module] = {}


@pytest.fixture(scope="session")
def v4_ref(tiny_v4_model) -> Reference:
    return reference(tiny_v4_model, 0, LENS, NEW)


def _engine(ref: Reference, **kw) -> LLMEngine:
    if ref.model_dir not in _models:
        _models[ref.model_dir] = load_model(ref.model_dir)
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("num_speculative_tokens", 0)
    return LLMEngine(EngineConfig(model=ref.model_dir, **kw), model=_models[ref.model_dir])


def _greedy(n: int = NEW, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **extra)


def _run(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int]]]], n: int = NEW) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, prompt in arrivals.get(step, []):
            engine.add_request(rid, prompt, _greedy(n))
            outs[rid] = []
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
        step += 1
        assert step < 10_000
    return outs


def _all_at_once(ref: Reference) -> dict[int, list[tuple[str, list[int]]]]:
    return {0: [(f"r{i}", p) for i, p in enumerate(ref.prompts)]}


def _outputs(ref: Reference, outs: dict[str, list[int]]) -> list[list[int]]:
    return [outs[f"r{i}"] for i in range(len(ref.prompts))]


def _leak_free(eng: LLMEngine) -> None:
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert eng.blocks.num_free_rings == eng.blocks.num_rings
    eng.blocks.check()


def test_one_at_a_time(v4_ref):
    eng = _engine(v4_ref)
    for i, p in enumerate(v4_ref.prompts):
        assert _run(eng, {0: [(f"r{i}", p)]})[f"r{i}"] == v4_ref.outputs[i], f"prompt {i} (len {len(p)})"
    _leak_free(eng)


@pytest.mark.parametrize("spec", [0, 2])
def test_batched(v4_ref, spec):
    eng = _engine(v4_ref, num_speculative_tokens=spec, max_num_batched_tokens=512)
    assert _outputs(v4_ref, _run(eng, _all_at_once(v4_ref))) == v4_ref.outputs
    _leak_free(eng)


def test_requests_join_mid_flight_with_chunked_prefill(v4_ref):
    # Chunks of 13 end inside CSA (4) and HCA (16) groups and inside the window (8).
    eng = _engine(v4_ref, max_num_batched_tokens=13)
    arrivals = {3 * i: [(f"r{i}", p)] for i, p in enumerate(v4_ref.prompts)}
    assert _outputs(v4_ref, _run(eng, arrivals)) == v4_ref.outputs
    _leak_free(eng)


def test_preemption_keeps_outputs(v4_ref):
    eng = _engine(v4_ref, num_kv_blocks=12, max_num_batched_tokens=128)
    preempted = 0
    real = eng.step

    def step():
        nonlocal preempted
        out = real()
        preempted += len(eng.last_stats.preempted)
        return out

    eng.step = step
    assert _outputs(v4_ref, _run(eng, _all_at_once(v4_ref))) == v4_ref.outputs
    assert preempted > 0
    _leak_free(eng)


@pytest.mark.parametrize("spec", [0, 2])
def test_prefill_export_import_decode_on_another_engine(v4_ref, spec):
    pre = _engine(v4_ref, role="prefill", max_num_batched_tokens=40)
    dec = _engine(v4_ref, role="decode", num_speculative_tokens=spec)
    for i, p in enumerate(v4_ref.prompts):
        pre.add_request(f"r{i}", p, _greedy())
    firsts = {}
    while pre.has_unfinished():
        for o in pre.step():
            assert o.prefill_done and len(o.new_token_ids) == 1
            firsts[o.request_id] = o.new_token_ids
    for i, p in enumerate(v4_ref.prompts):
        rid = f"r{i}"
        n = pre.blocks.blocks_for(len(p))
        kv = pre.export_kv(rid).clone()  # what a transport would carry
        assert kv.shape == pre.kv_shape(n) and kv.numel() * kv.element_size() == describe(pre).nbytes(n)
        pre.release(rid)
        dec.add_prefilled(rid, p + firsts[rid], len(p), _greedy(), kv)
    _leak_free(pre)
    outs = {rid: list(t) for rid, t in firsts.items()}
    while dec.has_unfinished():
        for o in dec.step():
            outs[o.request_id] += o.new_token_ids
    assert _outputs(v4_ref, outs) == v4_ref.outputs
    _leak_free(dec)


def test_every_step_logits_match_within_1e4(v4_ref, monkeypatch):
    """Teacher-forced: the reference's tokens are fed back; every step's logits agree."""
    eng = _engine(v4_ref, max_num_batched_tokens=64)
    ours: dict[str, list[torch.Tensor]] = {}
    real_sample = sampler_mod.sample

    def forced(logits, params, gens):
        toks = real_sample(logits, params, gens)
        for r, p in enumerate(params):
            rid = p.extra["rid"]
            ours.setdefault(rid, []).append(logits[r].clone())
            toks[r] = v4_ref.outputs[int(rid[1:])][len(ours[rid]) - 1]
        return toks

    monkeypatch.setattr(sampler_mod, "sample", forced)
    for i, p in enumerate(v4_ref.prompts):
        eng.add_request(f"r{i}", p, _greedy(extra={"rid": f"r{i}"}))
    while eng.has_unfinished():
        eng.step()
    worst = 0.0
    for i in range(len(v4_ref.prompts)):
        got = torch.stack(ours[f"r{i}"])
        assert got.shape == v4_ref.logits[i].shape
        worst = max(worst, (got - v4_ref.logits[i]).abs().max().item())
    assert worst < 1e-4, worst


def test_mtp_head_matches_its_reference_and_drafts_its_argmax(v4_ref, monkeypatch):
    """The MTP layer (which transformers does not load) against transformers' decoder
    layer holding its weights, at every position of a prompt; each draft is the argmax."""
    # Without prefix caching: with it, the prefill would be cut at its last boundary (32)
    # to snapshot there, and this test wants the whole prompt in one MTP pass.
    eng = _engine(v4_ref, num_speculative_tokens=1, max_num_batched_tokens=512, enable_prefix_caching=False)
    model = eng.model
    seen: list[torch.Tensor] = []
    real = model.mtp_forward

    def spy(batch, prev, cache):
        h = real(batch, prev, cache)
        seen.append(h)
        return h

    monkeypatch.setattr(model, "mtp_forward", spy)
    i = LENS.index(47)
    p, out = v4_ref.prompts[i], v4_ref.outputs[i]
    eng.add_request("r", p, _greedy(4))
    eng.step()  # the prefill: the MTP pass covers positions 0 .. len(p)-1
    ours = model.mtp_logits(seen[0])
    want = mtp_reference_logits(v4_ref.model_dir, model, p + out[:1])
    assert ours.shape == want.shape
    assert (ours - want).abs().max().item() < 1e-4
    eng.drafter.resolve()
    assert eng.seqs["r"].draft_ids == [int(want[-1].argmax())]


def test_planted_drafts_are_accepted_and_output_unchanged(v4_ref, monkeypatch):
    """Random MTP weights rarely agree with the target, so drafts come from the known
    answer, with wrong guesses mixed in: right ones are accepted, wrong ones rejected,
    and the output is the reference's."""
    eng = _engine(v4_ref, num_speculative_tokens=3, max_num_batched_tokens=512)
    real_propose = eng.drafter.propose

    def propose(work, hidden):
        real_propose(work, hidden)  # still fills the MTP layer's window
        for c, _ in work:
            seq = c.seq
            if seq.draft_ids:
                i = int(seq.request_id[1:])
                n = seq.num_output_tokens
                good = v4_ref.outputs[i][n : n + len(seq.draft_ids)]
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
    assert _outputs(v4_ref, _run(eng, _all_at_once(v4_ref))) == v4_ref.outputs
    _leak_free(eng)
    assert accepted > NEW * len(LENS) // 3, (accepted, drafted)
    assert drafted > accepted


# Architectures the presets do not have: other compress-rate schedules (legacy spelling
# included), hash-layer counts, hc_mult, o_groups, head counts and widths.
VARIANTS = {
    # transformers reads legacy ratios only as 0, 4 and 128, so HCA groups are 128 long here.
    "legacy-schedule": dict(
        layer_types=None, mlp_layer_types=None, compress_rates=None, compress_ratios=[4, 0, 128, 4, 0, 0],
        num_hidden_layers=5, num_hash_layers=1, partial_rotary_factor=None, qk_rope_head_dim=16,
        sliding_window=12, index_topk=3),
    "wide-heads": dict(
        num_attention_heads=8, head_dim=16, partial_rotary_factor=0.5, o_groups=4, o_lora_rank=8, hc_mult=2,
        hc_sinkhorn_iters=5, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], index_head_dim=8,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "heavily_compressed_attention"], num_experts_per_tok=3, scoring_func="sigmoid",
        sliding_window=5, num_nextn_predict_layers=0),
}
VARIANT_LENS = [3, 17, 40, 140]


@pytest.fixture(scope="session", params=sorted(VARIANTS))
def variant_ref(request, tmp_path_factory) -> Reference:
    from moemesh.shared.checkpoint.writer import init_model

    d = init_model(tmp_path_factory.mktemp(request.param), "v4-tiny", seed=7, overrides=VARIANTS[request.param])
    return reference(str(d), 3, VARIANT_LENS, 10)


def test_other_architectures_greedy_and_logits(variant_ref, monkeypatch):
    ref = variant_ref
    eng = _engine(ref, max_num_batched_tokens=11, num_speculative_tokens=1)  # chunked, MTP on if present
    arrivals = {2 * i: [(f"r{i}", p)] for i, p in enumerate(ref.prompts)}
    assert _outputs(ref, _run(eng, arrivals, 10)) == ref.outputs
    _leak_free(eng)

    eng = _engine(ref, max_num_batched_tokens=64)
    ours: dict[str, list[torch.Tensor]] = {}
    real_sample = sampler_mod.sample

    def forced(logits, params, gens):
        toks = real_sample(logits, params, gens)
        for r, p in enumerate(params):
            rid = p.extra["rid"]
            ours.setdefault(rid, []).append(logits[r].clone())
            toks[r] = ref.outputs[int(rid[1:])][len(ours[rid]) - 1]
        return toks

    monkeypatch.setattr(sampler_mod, "sample", forced)
    for i, p in enumerate(ref.prompts):
        eng.add_request(f"r{i}", p, _greedy(10, extra={"rid": f"r{i}"}))
    while eng.has_unfinished():
        eng.step()
    worst = max((torch.stack(ours[f"r{i}"]) - ref.logits[i]).abs().max().item() for i in range(len(ref.prompts)))
    assert worst < 1e-4, worst
