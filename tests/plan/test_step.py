"""The step model's terms: each does what it says, and switching one off removes exactly it."""

import pytest

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.plan import skew as skews
from moemesh.shared.plan.balance import balance
from moemesh.shared.plan.costs import FixedStep, Roofline
from moemesh.shared.plan.dims import from_config
from moemesh.shared.plan.hardware import get_hardware
from moemesh.shared.plan.host import HOSTS, HostModel
from moemesh.shared.plan.step import StepConfig, Terms, run_step
from moemesh.shared.plan.workload import get_workload

DIMS = from_config(preset_config("v3"), "v3")
COSTS = Roofline(DIMS, get_hardware("h200"))
WORK = get_workload("fixed:4096:512")
SKEW = skews.parse("zipf:0.69", 4, 256, 8, seed=0)  # 4 layers stand for all 58: fast


def _run(width, batch=64, phase="decode", host=HOSTS["after-9"], terms=Terms(), sk=SKEW, costs=COSTS, k=1):
    b = balance(sk, width, k, eplb=terms.eplb)
    return run_step(StepConfig(phase, width, batch, num_steps=16), DIMS, costs, b, sk.popularity, WORK, host, terms)


def test_terms_add_up_to_the_step():
    r = _run(8, host=HOSTS["before-9"])
    assert r.step_s == pytest.approx(sum(r.terms_s().values()), rel=1e-9)
    assert all(v >= 0 for v in r.terms_s().values())


@pytest.mark.parametrize("term", ["host", "barrier", "a2a"])
def test_switching_a_term_off_removes_exactly_it(term):
    full = _run(16, host=HOSTS["before-9"])
    off = _run(16, host=HOSTS["before-9"], terms=Terms.without(term))
    assert getattr(off, f"{term}_s") == 0
    assert off.step_s == pytest.approx(full.step_s - getattr(full, f"{term}_s"), rel=1e-6)


def test_barrier_grows_with_width_as_stalls_compound():
    host = HostModel("stalls", fixed_s=1e-3, stall_s=50e-3, stall_every=50)
    narrow, wide = (_run(w, host=host, terms=Terms(experts=False, a2a=False)) for w in (2, 32))
    own, inst = host.expected_stall_s(32)
    assert wide.barrier_s > 4 * narrow.barrier_s
    assert wide.barrier_s == pytest.approx(inst - own, rel=1e-9)  # no jitter: the stalls alone
    assert wide.host_s == pytest.approx(1e-3 + own, rel=1e-9)
    # One rank in 50 steps stalls; of 32 ranks, some rank in almost half the steps.
    assert inst == pytest.approx(50e-3 * (1 - 0.98 ** 32))


def test_eplb_shortens_the_expert_term_under_skew():
    # Prefill experts are compute-bound, so the hottest rank's pairs set their time.
    naive = _run(16, batch=4096, phase="prefill", terms=Terms(eplb=False))
    ours = _run(16, batch=4096, phase="prefill")
    assert ours.ratio_after > naive.ratio_after + 0.2
    assert ours.experts_s < 0.8 * naive.experts_s
    uniform = _run(16, terms=Terms(skew=False))
    assert uniform.ratio_before == 1.0
    # Decode at batch 64 reads every slot's weights whatever the placement: the skew
    # shows in the all-to-all (the hot rank receives more), not in the expert term.
    d_naive, d_ours = _run(16, terms=Terms(eplb=False)), _run(16)
    assert d_ours.experts_s == pytest.approx(d_naive.experts_s, rel=0.05)
    assert d_ours.a2a_s < d_naive.a2a_s


def test_one_rank_waits_for_nobody():
    r = _run(1, host=HOSTS["none"])
    assert r.rank_wait_s == 0 and r.a2a_s == 0 and r.barrier_s == 0


def test_wider_ranks_read_fewer_expert_weights_at_small_batch():
    # Decode at a small batch is memory-bound: a rank reads the weights of the slots it
    # holds, so DEP16 reads about half of DEP8's.
    r8, r16 = _run(8, batch=4, host=HOSTS["none"]), _run(16, batch=4, host=HOSTS["none"])
    assert r16.experts_s < 0.8 * r8.experts_s


def test_mock_step_is_the_fixed_step_plus_exposed_host():
    host = HostModel("h", fixed_s=2e-3, hidden_share=0.5)
    r = _run(1, batch=8, host=host, costs=FixedStep(1e-3))
    # Half the host hides, but only up to the 1 ms device step: 1 + 1 + (1 - 1) ms.
    assert r.step_s == pytest.approx(2e-3)
    assert r.tokens_per_s_per_gpu == pytest.approx(8 / 2e-3)


def test_prefill_steps_spend_the_token_budget():
    agentic = get_workload("agentic")
    b = balance(SKEW, 4, 1)
    r = run_step(StepConfig("prefill", 4, 16384, num_steps=8), DIMS, COSTS, b, SKEW.popularity, agentic,
                 HOSTS["after-9"])
    assert r.tokens_per_rank == 16384 and r.tokens_per_s_per_gpu > 0 and r.ttft_s > 0
    assert r.seqs_per_rank >= 1


def test_same_seed_same_answer():
    assert _run(8).step_s == _run(8).step_s


def test_unknown_term_is_an_error():
    with pytest.raises(ValueError, match="unknown term"):
        Terms.without("gpu")
    with pytest.raises(ValueError):
        StepConfig("train", 1, 1)


def test_mock_dep_ranks_step_at_the_busiest_rank_of_each_layer():
    from moemesh.shared.plan.costs import MockDEPStep

    costs = MockDEPStep(20e-3, 0.5, DIMS.num_moe_layers)
    uniform = _run(4, batch=64, host=HOSTS["none"], costs=costs, terms=Terms(skew=False))
    # Uniform routing: only the draws' noise above a 20 ms step.
    assert 20e-3 <= uniform.step_s < 21.5e-3 and uniform.a2a_s == 0
    naive = _run(4, batch=64, host=HOSTS["none"], costs=costs, terms=Terms(eplb=False))
    ours = _run(4, batch=64, host=HOSTS["none"], costs=costs)
    # The expert half takes 1 / (the layer's balance) of its balanced time.
    assert naive.experts_s == pytest.approx(10e-3 / naive.ratio_after, rel=0.1)
    assert ours.step_s < naive.step_s and ours.ratio_after > naive.ratio_after


def test_the_mock_hardware_spelling(tmp_path):
    from moemesh.tools.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "v3", "--hardware", "mock:20:0.5", "--gpus", "4", "--widths", "4",
                 "--decode-batch", "16", "--steps", "4", "--out", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    assert main(["plan", "--hardware", "mock:fast", "--out", str(out)]) == 2
