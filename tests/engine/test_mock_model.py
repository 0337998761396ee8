"""The mock engine's step clock and draft head (shared/engine/mock_model.py)."""

from __future__ import annotations

import time
from time import sleep as host_sleep  # not patched below

import pytest
import torch

from moemesh.shared.engine import mock_model
from moemesh.shared.engine.mock_model import MockModel
from moemesh.shared.model.config import ModelConfig


class _Batch:
    queued_at = 0.0
    positions = torch.zeros(1, dtype=torch.long)
    row_keys = None


def _step(model: MockModel, host_s: float = 0.0) -> float:
    t = time.perf_counter()
    model(_Batch(), None)
    host_sleep(host_s)  # the host's work inside the step (sampling, output processing)
    model.synchronize()
    return time.perf_counter() - t


def test_a_stalled_wake_up_does_not_shorten_the_steps_after_it(tiny_model, monkeypatch):
    step_s = 0.02
    model = MockModel(ModelConfig.from_dir(tiny_model), step_s)
    real_sleep = time.sleep
    # One wake-up 200 ms late, as when the process is starved of CPU for a while.
    stalls = iter([0.2])
    monkeypatch.setattr(mock_model.time, "sleep", lambda s: real_sleep(s + next(stalls, 0.0)))
    _step(model)
    # Then steps whose host work takes most of the step: without a bound on the
    # correction these took the host's 12 ms, not the set 20.
    took = [_step(model, host_s=0.012) for _ in range(10)]
    assert min(took) > 0.7 * step_s, took


def _run(tiny_model, k: int | None, accept: float | None, n: int = 24, max_tokens: int = 40):
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.protocol.messages import SamplingParams

    mock = MockModel(ModelConfig.from_dir(tiny_model), 0.0, accept)
    eng = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=512, max_num_seqs=n, num_speculative_tokens=k),
                    model=mock)
    for i in range(n):  # prompts of different lengths: the streams sit at different positions
        eng.add_request(f"req-{i}", [0] + [5 + j for j in range(1 + i % 7)],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished() and steps < 10_000:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
    return out, eng, steps


def test_the_mock_drafts_and_the_engine_verifies_them_at_the_set_rate(tiny_model):
    """With a draft head the mock's drafts go through the engine's real verification: the
    output is what the mock emits without drafts, and the share of drafts accepted is the
    set rate (deterministic: a hash of request and position decides each)."""
    want, _, plain_steps = _run(tiny_model, 0, None)
    for k, rate in ((1, 0.7), (2, 0.7), (1, 0.0), (2, 1.0)):
        got, eng, steps = _run(tiny_model, k, rate)
        assert got == want, (k, rate)
        assert eng.use_mtp and eng.num_drafted_total > 0
        share = eng.num_accepted_total / eng.num_drafted_total
        want_share = sum(rate**j for j in range(1, k + 1)) / k  # in order: draft j needs the j-1 before it
        assert abs(share - want_share) < 0.05 if 0 < rate < 1 else share == rate, (k, rate, share)
        if rate > 0:
            assert steps < plain_steps  # accepted drafts: more than one token a step
        else:
            assert steps >= plain_steps


def test_a_mock_without_a_draft_head_drafts_nothing(tiny_model):
    _, eng, _ = _run(tiny_model, 2, None, n=2, max_tokens=4)
    assert not eng.use_mtp and eng.num_drafted_total == 0


def test_the_mock_drafts_on_a_deepseek_v4_config_through_its_hybrid_cache(tiny_v4_model):
    """engine = "mock" on a V4 config: rings and compressed entries are the engine's own,
    the draft head verified as on V2/V3; every block and ring comes back."""
    want, _, _ = _run(tiny_v4_model, 0, None, n=6, max_tokens=20)
    got, eng, _ = _run(tiny_v4_model, 1, 0.7, n=6, max_tokens=20)
    assert got == want and eng.hybrid and 0 < eng.num_accepted_total < eng.num_drafted_total
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and eng.blocks.num_free_rings == eng.blocks.num_rings


# ---- as a rank of a DEP instance -------------------------------------------------------
def test_a_lockstep_step_runs_at_its_most_loaded_rank_from_the_latest_start():
    step, s = 0.020, 0.5
    starts = torch.tensor([1.000, 1.002])
    # [src, layer, dst]: layer 0 sends rank 1 three times rank 0's pairs, layer 1 is even.
    sent = torch.tensor([[[10, 30], [20, 20]], [[10, 30], [20, 20]]])
    end, own0, inst = mock_model.lockstep_step(step, s, starts, sent, rank=0)
    _, own1, _ = mock_model.lockstep_step(step, s, starts, sent, rank=1)
    # layer 0: loads 20/60, mean 40 -> ratios 0.5/1.5; layer 1: 1/1.
    assert inst == pytest.approx(step * (0.5 + 0.5 * (1.5 + 1.0) / 2))
    assert own0 == pytest.approx(step * (0.5 + 0.5 * (0.5 + 1.0) / 2))
    assert own1 == pytest.approx(inst)  # the most loaded rank of every layer waits for no one's experts
    assert end == pytest.approx(1.002 + inst)


def test_a_balanced_or_empty_lockstep_step_takes_the_set_time():
    starts = torch.tensor([5.0, 5.0, 5.0])
    even = torch.full((3, 2, 3), 7)
    assert mock_model.lockstep_step(0.02, 0.5, starts, even, 2)[1:] == pytest.approx((0.02, 0.02))
    empty = torch.zeros(3, 2, 3, dtype=torch.long)
    assert mock_model.lockstep_step(0.02, 0.5, starts, empty, 0)[1:] == pytest.approx((0.02, 0.02))


def _mock_rank(tiny_model, skew: str, world: int = 2):
    """Rank 0 of a mock instance, its routing and placement only (no peers: route() alone)."""
    from moemesh.shared.engine.load_tracker import LoadTracker
    from moemesh.shared.model.expert_parallel import ExpertParallel
    from moemesh.shared.model.skew import apply_skew

    cfg = ModelConfig.from_dir(tiny_model)
    slots, _ = ExpertParallel.naive_slot_map(cfg.n_routed_experts, 0, world, 0)
    model = MockModel(cfg, 0.02, 0.7, mock_model.MockRanks(0, 1), slots)
    ep = ExpertParallel.naive(model, 0, world, 0)
    tracker = LoadTracker(model, 8)
    apply_skew(model, skew, "", 0)
    return model, ep, tracker


def test_mock_ranks_route_with_the_skew_and_a_move_shifts_the_load(tiny_model):
    model, ep, tracker = _mock_rank(tiny_model, "hot:3:5.0")
    assert sorted(model.moe_layers()) == [1, 2, 3]  # the tiny model's two MoE layers, and the MTP layer
    moe = model.moe_layers()[1]
    gen = torch.Generator().manual_seed(0)
    sent = moe.route(200, gen)
    tracker.end_step()
    counts = tracker.window()[0]
    assert counts.sum() == 200 * 4 and counts[3] == 200  # every row picks the hot expert, once
    assert sent.tolist()[0] > 1.5 * sent.tolist()[1]  # expert 3 and its group sit on rank 0
    # A placement that swaps the ranks' halves moves those pairs to rank 1.
    row = ep.layers[1].phy2log
    ep.layers[1].set_placement(torch.cat([row[8:], row[:8]]))
    moved = moe.route(200, torch.Generator().manual_seed(0))
    assert moved.tolist() == sent.flip(0).tolist()


def test_mock_expert_slots_hold_their_experts_ids(tiny_model):
    model, ep, _ = _mock_rank(tiny_model, "", world=4)
    gu = model.moe_layers()[2].experts.gate_up_proj
    assert [int(gu[i, 0, 0]) for i in range(gu.shape[0])] == [0, 1, 2, 3]  # rank 0's naive slots


def test_mock_expert_share_is_checked():
    with pytest.raises(ValueError, match="mock_expert_share"):
        mock_model.MockRanks(0, 2, expert_share=1.5)
