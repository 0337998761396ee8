"""Measured costs: the collectives' latency per width and how it enters the step."""

from dataclasses import replace

import numpy as np
import pytest

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.plan.balance import balance
from moemesh.shared.plan.calibrate import this_host
from moemesh.shared.plan.costs import by_width
from moemesh.shared.plan.dims import from_config
from moemesh.shared.plan.host import HOSTS
from moemesh.shared.plan.skew import parse
from moemesh.shared.plan.step import StepConfig, run_step
from moemesh.shared.plan.workload import get_workload

DIMS = from_config(preset_config("tiny"), "tiny")
FORWARD = {"bench": "forward", "decode": [{"batch": b, "forward_ms_p50": 2.0 + 0.25 * b} for b in (1, 4, 8, 16)],
           "prefill": []}
COLL = {"2": {"all_to_all_ms": 0.7, "all_gather_ms": 0.5},
        "4": {"all_to_all_ms": 2.8, "all_gather_ms": 2.0}}


def _step(costs, width, batch=4):
    sk = parse("uniform", DIMS.num_moe_layers, DIMS.num_experts, DIMS.top_k)
    bal = balance(sk, width, 0, eplb=False)
    return run_step(StepConfig("decode", width, batch, num_steps=16), DIMS, costs, bal, sk.popularity,
                    get_workload("fixed:128:32"), replace(HOSTS["after-9"], hidden_share=0.0))


def test_by_width_interpolates_and_extrapolates_past_the_widest():
    t = {2: 1.0, 4: 3.0}
    assert by_width(t, 2) == 1.0 and by_width(t, 3) == pytest.approx(2.0)
    assert by_width(t, 8) == pytest.approx(7.0)  # the slope of the widest two carries on
    assert by_width({4: 3.0}, 8) == 3.0 and by_width({}, 4) == 0.0


def test_each_width_gets_its_own_latency():
    costs = this_host(FORWARD, DIMS, collectives=COLL, copy_bw=float("inf"))
    pairs = np.full((3, 2), 10.0)
    assert np.allclose(costs.a2a_s(pairs, 2), 4 * 0.7e-3) and np.allclose(costs.a2a_s(pairs, 4), 4 * 2.8e-3)
    assert np.all(costs.a2a_s(pairs, 1) == 0)
    assert costs.sync_s(2) == pytest.approx(0.5e-3) and costs.sync_s(4) == pytest.approx(2.0e-3)
    assert costs.sync_s(1) == 0.0


def test_collective_latency_lengthens_the_step_and_is_all_wait():
    quiet = this_host(FORWARD, DIMS, copy_bw=float("inf"))
    slow = this_host(FORWARD, DIMS, collectives=COLL, copy_bw=float("inf"))
    a, b = _step(quiet, 4), _step(slow, 4)
    per_step = 2 * 4 * 2.8e-3 + 2.0e-3  # two MoE layers of four all-to-alls, one agreement
    assert DIMS.num_moe_layers == 2
    assert b.step_s - a.step_s == pytest.approx(per_step, rel=1e-9)
    assert b.rank_wait_s - a.rank_wait_s == pytest.approx(per_step, rel=1e-9)
    assert b.a2a_s == pytest.approx(per_step, rel=1e-9)


def test_latency_does_not_count_against_the_shared_processors():
    # Enough processors: the step is each rank's path, compute + latency.
    roomy = this_host(FORWARD, DIMS, collectives=COLL, cores=8.0, copy_bw=float("inf"))
    r = _step(roomy, 4)
    assert r.barrier_s == pytest.approx(_step(replace(roomy, cores=0.0), 4).barrier_s)
    # Too few: the step is the ranks' CPU over them, whatever the latency, as long as
    # that bound is the longer path.
    tight = replace(roomy, cores=0.25)
    lo, hi = _step(replace(tight, agree_s_by_width={}), 4), _step(tight, 4)
    assert lo.step_s == pytest.approx(hi.step_s, rel=1e-9)
    assert hi.extra["work_s"] / 0.25 == pytest.approx(hi.step_s, rel=1e-9)


def test_speed_stretches_the_ranks_compute_not_the_collectives():
    base = this_host(FORWARD, DIMS, collectives=COLL, copy_bw=float("inf"))
    a, b = _step(base, 2), _step(replace(base, speed=0.5), 2)
    assert b.attention_s == pytest.approx(2 * a.attention_s) and b.experts_s == pytest.approx(2 * a.experts_s)
    assert b.a2a_s == pytest.approx(a.a2a_s)
    with pytest.raises(ValueError):
        replace(base, speed=0.0)


def test_width_one_makes_no_collectives():
    r = _step(this_host(FORWARD, DIMS, collectives=COLL), 1)
    assert r.a2a_s == 0 and r.rank_wait_s == 0
