"""The validation's arithmetic: fitted figures are recovered from runs the model made itself."""

from dataclasses import replace

import pytest

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.plan import check
from moemesh.shared.plan.calibrate import host_from_decode, this_host
from moemesh.shared.plan.dims import from_config
from moemesh.shared.plan.host import HOSTS

DIMS = from_config(preset_config("tiny"), "tiny")
FORWARD = {"bench": "forward", "decode": [{"batch": b, "forward_ms_p50": 2.0 + 0.25 * b} for b in (1, 4, 8, 16)],
           "prefill": []}
WINDOW = {"target": [[40] * 4 + [5] * 12, [5] * 12 + [40] * 4]}


COLLECTIVES = {"2": {"all_to_all_ms": 0.7, "all_gather_ms": 0.5},
               "4": {"all_to_all_ms": 2.8, "all_gather_ms": 2.0}}


def _truth():
    costs = this_host(FORWARD, DIMS, cores=2.0, collectives=COLLECTIVES)
    return replace(costs, slot_s=20e-6, pair_s=2e-6, ep_layer_s=0.4e-3, speed=0.6)


def _case(name, width, window=None):
    """A run as the model itself predicts it with the true figures."""
    c = check.Case(name, "dep", width, 16, 1.0, 0.0, window=window)
    r = check.predict(c, DIMS, _truth(), check.host_for(c, HOSTS["after-9"]), 128, 32)
    return replace(c, measured_tps=width * r.tokens_per_s_per_gpu, measured_wait_s=check.rank0_wait_s(r))


def test_fit_recovers_the_hidden_figures():
    cases = [_case("DEP1 balanced", 1), _case("DEP2 balanced", 2), _case("DEP2 skewed", 2, WINDOW),
             _case("DEP4 skewed", 4, WINDOW)]
    base = replace(_truth(), ep_layer_s=0.0, speed=1.0)
    out = check.compare(cases, DIMS, base, HOSTS["after-9"], 128, 32)
    assert out["fitted_on"] == ["DEP1 balanced", "DEP2 balanced"]
    f = out["fitted"]
    assert f["speed"] == pytest.approx(0.6, rel=1e-6)
    # The speed alone, before the collectives are known (plan-check times them at it).
    no_coll = replace(base, collective_s_by_width={}, agree_s_by_width={})
    assert check.fit_speed(cases, DIMS, no_coll, HOSTS["after-9"], 128, 32) == pytest.approx(0.6, rel=1e-6)
    assert f["ep_layer_ms"] == pytest.approx(0.4, rel=1e-3)
    assert f["all_to_all_ms"] == {2: pytest.approx(0.7), 4: pytest.approx(2.8)}
    assert all(r["holds"] for r in out["rows"]), out["rows"]
    assert all(abs(r["tps_error"]) < 1e-3 for r in out["rows"]), out["rows"]
    skewed = next(r for r in out["rows"] if r["case"] == "DEP4 skewed")
    assert skewed["predicted_ratio"] < 0.9
    # Four ranks: eight all-to-alls and the agreement, a step mostly spent waiting in them.
    assert skewed["predicted_terms_ms"]["a2a"] > skewed["predicted_terms_ms"]["experts"]
    assert skewed["predicted_wait_ms"] > 2 * 4 * 2.8 + 2.0
    assert "DEP4 skewed" in check.table(out)


def test_a_wrong_prediction_is_reported_as_a_miss():
    c = _case("DEP2 skewed", 2, WINDOW)
    out = check.compare([replace(c, measured_tps=c.measured_tps * 2)], DIMS, _truth(), HOSTS["after-9"], 128, 32)
    assert out["fitted_on"] == [] and not out["rows"][0]["holds"]


def test_mock_runs_are_predicted_from_the_step_and_host():
    c = check.Case("mock", "mock", 1, 64, 64 / 20.04e-3, 0.0, step_ms=20.0)
    r = check.compare([c], DIMS, _truth(), HOSTS["after-9"], 128, 32)["rows"][0]
    assert r["holds"] and abs(r["tps_error"]) < 0.01


def test_host_from_a_decode_result():
    res = {"runs": [{"points": [{"decode_steps": {"host_ms_p50": 2.0, "host_exposed_ms_p50": 0.5}},
                                {"decode_steps": {"host_ms_p50": 4.0, "host_exposed_ms_p50": 1.0}}]}]}
    h = host_from_decode(res)
    assert h.fixed_s == pytest.approx(4e-3) and h.hidden_share == pytest.approx(0.75)
    with pytest.raises(ValueError):
        host_from_decode({"runs": []})
    with pytest.raises(ValueError, match="bench forward"):
        this_host({"bench": "decode"}, DIMS)


def test_the_lockstep_and_mtp_presets_give_back_the_runs_they_were_fit_to():
    """Host per step as a DEP rank and an MTP step run now, none of it hidden."""
    lock, mtp = HOSTS["lockstep"], HOSTS["mtp"]
    assert lock.hidden_share == mtp.hidden_share == 0.0
    assert lock.host_s(8) == pytest.approx(0.7e-3) and lock.host_s(32) == pytest.approx(1.0e-3)
    assert mtp.host_s(64) == pytest.approx(2.6e-3, rel=0.05) and mtp.host_s(256) == pytest.approx(8.2e-3, rel=0.05)
