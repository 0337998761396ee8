"""`moemesh plan` as a user runs it: tables, JSON, PNG, the seed scenario, clean errors."""

import json

import pytest

from tests.cli_in_process import moemesh


def test_plan_prints_both_phases_and_writes_json_and_png(tmp_path, tiny_model):
    out = tmp_path / "plan.json"
    r = moemesh("plan", "--model", tiny_model, "--hardware", "h200", "--gpus", "4", "--workload", "chat",
                "--skew", "zipf:1.0", "--draft-skew", "", "--steps", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "prefill" in r.stdout and "decode" in r.stdout and "recommended" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["bench"] == "plan" and [x["width"] for x in doc["decode"]] == [1, 2, 4]
    assert {"attention_s", "experts_s", "a2a_s", "host_s", "barrier_s", "ratio_before", "ratio_after"} \
        <= set(doc["prefill"][0])
    assert out.with_suffix(".png").stat().st_size > 1000


def test_plan_takes_a_recorded_window_and_a_host_overhead(tmp_path, tiny_model):
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps({"loads": {"target": [[50] * 8 + [1] * 8, [1] * 8 + [50] * 8]}}))
    r = moemesh("plan", "--model", tiny_model, "--hardware", "b200", "--gpus", "4", "--workload", "fixed:256:32",
                "--skew", f"file:{loads}", "--draft-skew", "", "--host-overhead-ms", "3", "--steps", "4",
                "--decode-batch", "8", "--without", "a2a", "--out", str(tmp_path / "p.json"), "--plot",
                str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    two = next(x for x in doc["decode"] if x["width"] == 2)
    assert two["ratio_before"] < 0.7 and two["a2a_s"] == 0 and two["host_s"] >= 3e-3


def test_plan_seed_scenario_states_its_assumptions(tmp_path):
    r = moemesh("plan", "--scenario", "seed", "--out", str(tmp_path / "seed.json"))
    assert r.returncode == 0, r.stderr
    assert "assumptions" in r.stdout and "prefill_dep4_over_dep2" in r.stdout
    doc = json.loads((tmp_path / "seed.json").read_text())
    assert doc["assumptions"] and doc["all_hold"], doc["checks"]


def test_plan_bad_input_is_a_clean_error(tmp_path):
    r = moemesh("plan", "--hardware", "tpu", "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2 and "unknown hardware" in r.stderr and "Traceback" not in r.stderr
    r = moemesh("plan", "--model", "v3", "--widths", "3", "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2 and "divide" in r.stderr


def test_plan_on_this_host_from_a_forward_result(tmp_path, tiny_model):
    fwd = tmp_path / "forward.json"
    fwd.write_text(json.dumps({"bench": "forward", "decode": [{"batch": b, "forward_ms_p50": 2 + 0.2 * b}
                                                              for b in (1, 8, 64)],
                               "prefill": [{"prompt_len": n, "forward_ms_p50": 0.05 * n} for n in (128, 2048)]}))
    r = moemesh("plan", "--model", tiny_model, "--hardware", "this-host", "--forward", str(fwd), "--gpus", "2",
                "--workload", "fixed:128:16", "--draft-skew", "", "--steps", "4", "--prefill-tokens", "512",
                "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    one = next(x for x in doc["decode"] if x["width"] == 1)
    # One rank on this host: its step is the measured forward at its batch, plus its host time.
    assert one["attention_s"] + one["experts_s"] == pytest.approx((2 + 0.2 * one["batch"]) / 1e3, rel=0.05)
    r = moemesh("plan", "--model", tiny_model, "--hardware", "this-host", "--out", str(tmp_path / "q.json"))
    assert r.returncode == 2 and "--forward" in r.stderr


def test_plan_on_this_host_from_a_plan_check_result(tmp_path, tiny_model):
    # A plan-check result carries the collectives' latency and the figures fitted in the mesh.
    pc = tmp_path / "plan_check.json"
    pc.write_text(json.dumps({
        "bench": "plan-check", "forward": [{"batch": b, "forward_ms_p50": 2 + 0.2 * b} for b in (1, 8, 16)],
        "collectives": {"2": {"all_to_all_ms": 0.7, "all_gather_ms": 1.2}},
        "comparison": {"fitted": {"speed": 0.5, "ep_layer_ms": 1.0, "cores": 2.0, "slot_us": 40.0, "pair_us": 0.5}}}))
    r = moemesh("plan", "--model", tiny_model, "--hardware", "this-host", "--forward", str(pc), "--gpus", "2",
                "--workload", "fixed:128:16", "--skew", "uniform", "--draft-skew", "", "--steps", "4",
                "--prefill-tokens", "512", "--decode-batch", "8", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    two = next(x for x in json.loads((tmp_path / "p.json").read_text())["decode"] if x["width"] == 2)
    # Two MoE layers of four all-to-alls, and the agreement once a step.
    assert two["a2a_s"] == pytest.approx((2 * 4 * 0.7 + 1.2) / 1e3, rel=0.02)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"bench": "plan-check", "forward": []}))
    r = moemesh("plan", "--model", tiny_model, "--hardware", "this-host", "--forward", str(bad),
                "--out", str(tmp_path / "q.json"))
    assert r.returncode == 2 and "plan-check" in r.stderr and "Traceback" not in r.stderr
