import pytest

from moemesh.tools.profile.overhead import OverheadInputError, analyse, split


def decode_result() -> dict:
    def pt(b, e2e, fo, steps):
        return {"batch": b, "e2e_tokens_per_s": e2e, "forward_only_tokens_per_s": fo,
                "serving_overhead": 1 - e2e / fo, "errors": 0, "decode_steps": steps}

    points = [
        pt(4, 100.0, 400.0, {}),
        pt(8, 800.0, 1000.0, {"forward_ms_p50": 8.5, "host_ms_p50": 0.6, "rank_wait_ms_p50": 0.2,
                              "loop_gap_ms_p50": 0.1, "step_ms_p50": 9.3}),
        pt(32, 2400.0, 3200.0, {}),
        pt(64, 3200.0, 4000.0, {"forward_ms_p50": 16.0, "host_ms_p50": 2.0, "rank_wait_ms_p50": 0.0}),
        pt(512, 10000.0, 20000.0, {}),
    ]
    return {"bench": "decode", "config": {"isl": 512, "osl": 64}, "forward_only": [],
            "runs": [{"label": "run", "skew": "", "points": points},
                     {"label": "skewed", "skew": "zipf:1.2", "points": [pt(8, 500.0, 1000.0, {})]}]}


def test_split_parts_add_up_to_the_overhead():
    s = split(8, 800.0, 1000.0, {"forward_ms_p50": 8.5, "host_ms_p50": 0.6, "rank_wait_ms_p50": 0.2,
                                 "loop_gap_ms_p50": 0.1})
    assert s["serving_overhead"] == pytest.approx(0.2)
    assert s["t_e2e_ms"] == pytest.approx(10.0) and s["t_forward_ms"] == pytest.approx(8.0)
    p = s["parts"]
    assert p["host"] == pytest.approx(0.06) and p["rank_wait"] == pytest.approx(0.02)
    assert p["forward_drift"] == pytest.approx(0.05) and p["rest"] == pytest.approx(0.07)
    assert sum(p.values()) == pytest.approx(s["serving_overhead"])
    assert s["loop_gap"] == pytest.approx(0.01)


def test_analyse_per_batch_and_headline_over_8_to_256():
    o = analyse(decode_result())
    run, skewed = o["runs"]
    assert [p["batch"] for p in run["points"]] == [4, 8, 32, 64, 512]
    by_b = {p["batch"]: p for p in run["points"]}
    assert by_b[32]["serving_overhead"] == pytest.approx(0.25) and by_b[32]["parts"] is None
    assert by_b[64]["parts"]["host"] == pytest.approx(0.1) and by_b[64]["parts"]["rest"] == pytest.approx(0.1)
    h = run["headline"]
    assert h["batches"] == [8, 32, 64]
    assert h["mean"] == pytest.approx((0.2 + 0.25 + 0.2) / 3)
    assert (h["min"], h["min_batch"]) == (pytest.approx(0.2), 8)
    assert (h["max"], h["max_batch"]) == (pytest.approx(0.25), 32)
    assert h["parts_over_batches"] == [8, 64]
    assert h["parts"] == pytest.approx({"host": 0.08, "rank_wait": 0.01, "forward_drift": 0.025, "rest": 0.085})
    assert h["loop_gap"] == pytest.approx(0.01)
    assert skewed["headline"]["mean"] == pytest.approx(0.5) and skewed["headline"]["parts"] is None
    assert o["notes"] == []


def test_separate_forward_run_replaces_the_forward_only_figures():
    fwd = {"bench": "forward", "decode": [{"batch": 8, "context_len": 544, "forward_tokens_per_s": 1600.0},
                                          {"batch": 32, "context_len": 544, "forward_tokens_per_s": 4800.0}]}
    o = analyse(decode_result(), fwd)
    run = o["runs"][0]
    assert [p["batch"] for p in run["points"]] == [8, 32]
    assert run["points"][0]["serving_overhead"] == pytest.approx(0.5)
    assert run["points"][0]["forward_source"] == "forward file"
    assert run["points"][0]["parts"]["forward_drift"] == pytest.approx((8.5 - 5.0) / 10.0)
    assert run["headline"]["mean"] == pytest.approx((0.5 + 0.5) / 2)
    assert any("batch 64 left out" in n for n in o["notes"])
    assert not any("context" in n for n in o["notes"])  # 512 + 64 / 2 = 544 matches
    fwd["decode"][0]["context_len"] = fwd["decode"][1]["context_len"] = 128
    assert any("context [128]" in n for n in analyse(decode_result(), fwd)["notes"])


def test_headline_absent_when_no_batch_in_range():
    o = analyse(decode_result(), min_batch=1000, max_batch=2000)
    assert o["runs"][0]["headline"] is None


@pytest.mark.parametrize("bad", [{}, {"bench": "forward", "decode": []}, {"bench": "decode", "runs": None}])
def test_wrong_input_raises_one_clear_error(bad):
    with pytest.raises(OverheadInputError):
        analyse(bad)
    with pytest.raises(OverheadInputError):
        analyse(decode_result(), {"bench": "decode"})
