import pytest

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.plan import report, skew as skews
from moemesh.shared.plan.costs import Roofline
from moemesh.shared.plan.dims import from_config
from moemesh.shared.plan.hardware import get_hardware
from moemesh.shared.plan.host import HOSTS
from moemesh.shared.plan.sweep import Inputs, PlanConfig, max_decode_batch, plan
from moemesh.shared.plan.workload import get_workload


def _inputs(hw="gb200-nvl72", model="v3"):
    dims = from_config(preset_config(model), model)
    h = get_hardware(hw)
    target = skews.parse("zipf:0.69", 4, dims.num_experts, dims.top_k)
    draft = skews.parse("hot:4:0.42", 1, dims.num_experts, dims.top_k)
    return Inputs(dims, Roofline(dims, h), h, get_workload("chat"), HOSTS["after-9"], target, draft)


def test_plan_recommends_widths_and_pools_within_the_gpus():
    p = plan(PlanConfig(gpus=16, num_steps=4, target_tps_user=10), _inputs())
    assert [r.width for r in p.prefill] == [1, 2, 4, 8, 16]
    assert p.prefill_width == max(p.prefill, key=lambda r: r.tokens_per_s_per_gpu).width
    assert p.decode_width in [r.width for r in p.decode if r.extra["meets_target"]]
    q = p.pools
    assert q.prefill_gpus + q.decode_gpus <= 16 and q.requests_per_s > 0
    assert set(p.draft_ratios) == {1, 2, 4, 8, 16}
    text = report.text(p)
    assert "recommended" in text and "DEP" in text
    d = report.to_dict(p)
    assert d["recommended"]["decode_width"] == p.decode_width


def test_decode_batch_meets_the_target_and_fits_memory():
    inp = _inputs()
    p = plan(PlanConfig(gpus=8, widths=(8,), num_steps=4, target_tps_user=30), inp)
    r = p.decode[0]
    assert r.tps_per_user_p90 >= 30 and r.batch <= r.extra["batch_cap"]
    # V3 weights alone overflow one H200: no batch fits at DEP1.
    assert max_decode_batch(inp.dims, get_hardware("h200"), 1, 0, 4096) == 0


def test_widths_must_divide_the_experts():
    with pytest.raises(ValueError, match="divide"):
        PlanConfig(gpus=8, widths=(3,)).width_list(256)
