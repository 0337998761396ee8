"""Every benchmark end to end on the tiny model, small enough to take seconds each:
they run, print, and their JSON carries every field a report needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest


def bench(tmp_path, tiny_model, *args, timeout=240):
    out = tmp_path / "r.json"
    env = dict(os.environ, MOEMESH_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-m", "moemesh.tools.cli.main", "bench", *args, "--out", str(out)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


def test_kv_transfer(tmp_path, tiny_model):
    res, out = bench(tmp_path, tiny_model, "kv-transfer", "--sizes", "65536,1048576", "--iters", "2", "--repeats", "1")
    assert "machine copy bandwidth" in out
    row = res["results"][1]
    assert row["bytes"] == 1 << 20 and row["ucx_one_GBps"] > 0 and row["ucx_concurrent_GBps"] > 0
    assert res["machine_copy_GBps"] > 0 and "min_ratio_at_1MiB_plus" in res
    assert res["machine_copy_pieces_GBps"] > 0 and res["pieces_bytes"] <= 1 << 20
    assert res["min_ratio_at_1MiB_plus_pieces"]["one"] > 0
    assert "pieces, with the stores a transfer makes" in out


def test_the_copy_ceiling_knows_where_glibc_stores_past_the_cache():
    """The one 256 MiB memcpy can take glibc's non-temporal path, which no transfer takes:
    the bench reads the threshold and copies in pieces below it for the ordinary-store ceiling."""
    from moemesh.tools.bench.kv_transfer import ceiling_piece, copy_bandwidth, parse_non_temporal_threshold

    text = ("glibc.cpu.x86_rep_movsb_threshold: 0x840 (min: 0x100, max: 0xffffffffffffffff)\n"
            "glibc.cpu.x86_non_temporal_threshold: 0xc000000 (min: 0x4040, max: 0xfffffffffffffff)\n")
    assert parse_non_temporal_threshold(text) == 192 << 20
    assert parse_non_temporal_threshold("glibc.malloc.mxfast: 0x0\n") is None
    assert ceiling_piece(192 << 20) == 1 << 20 and ceiling_piece(None) == 1 << 20
    assert ceiling_piece(1 << 20) == 512 << 10  # a small threshold: no piece crosses it
    assert copy_bandwidth(4 << 20, 0.0, piece=1 << 20) > 0 and copy_bandwidth(1 << 20, 0.0, piece=4 << 20) > 0


def test_kv_transfer_table_below_1mib():
    """Sizes under 1 MiB only: no goal line (the goal starts at 1 MiB), and no crash."""
    from moemesh.tools.bench.kv_transfer import table

    row = {"bytes": 65536, "ucx_one_GBps": 1.0, "ratio_one": 0.1, "ucx_concurrent_GBps": 2.0,
           "ratio_concurrent": 0.2, "memcpy_same_size_GBps": 20.0}
    out = table({"machine_copy_GBps": 10.0, "results": [row], "goal_ratio": 0.7,
                 "min_ratio_at_1MiB_plus": {"one": None, "concurrent": None}})
    assert "64 KiB" in out and "goal" not in out


@pytest.mark.slow  # a whole mesh for a bench tool's smoke run: -m slow
def test_kv_transfer_per_request_sizes(tmp_path):
    res, out = bench(tmp_path, None, "kv-transfer", "--context-lens", "128", "--iters", "1", "--repeats", "1")
    per = {r["cache"]: r for r in res["per_request"]}
    assert set(per) == {"V4-Flash", "V3 (published)", "V3 at V4-Flash's layer count"}
    assert sorted(r["bytes"] for r in res["results"]) == sorted(r["bytes"] for r in per.values())
    assert per["V3 (published)"]["bytes"] == 62 * 128 * 576 * 2
    assert all(r["ms_one"] > 0 and r["ms_concurrent"] > 0 for r in per.values())
    assert "V4-Flash, 128" in out


@pytest.mark.slow  # a whole mesh for a bench tool's smoke run: -m slow
def test_decode_and_prefill_phases(tmp_path, tiny_model):
    res, out = bench(tmp_path, tiny_model, "decode", "--model", tiny_model, "--isl", "32", "--osl", "8",
                     "--batch", "2", "--requests", "2")
    p = res["runs"][0]["points"][0]
    assert p["batch"] == 2 and p["e2e_tokens_per_s"] > 0 and p["forward_only_tokens_per_s"] > 0
    assert p["serving_overhead"] is not None and p["errors"] == 0
    assert {"forward_ms_p50", "host_ms_p50", "rank_wait_ms_p50"} <= set(p["decode_steps"])
    res, out = bench(tmp_path, tiny_model, "prefill", "--model", tiny_model, "--prompt-lens", "16,64", "--requests", "2")
    pts = res["runs"][0]["points"]
    assert [p["prompt_len"] for p in pts] == [16, 64] and all(p["ttft_ms_p50"] > 0 for p in pts)


@pytest.mark.slow  # a whole mesh for a bench tool's smoke run: -m slow
def test_decode_on_deepseek_v4(tmp_path, tiny_v4_model):
    # Both halves fabricate a V4 state buffer: the forward-only pass and the decode worker's bench jobs.
    res, out = bench(tmp_path, tiny_v4_model, "decode", "--model", tiny_v4_model, "--isl", "40", "--osl", "6",
                     "--batch", "2", "--requests", "2")
    [p] = res["runs"][0]["points"]
    assert p["batch"] == 2 and p["errors"] == 0 and p["e2e_tokens_per_s"] > 0 and p["forward_only_tokens_per_s"] > 0


def _check_overhead_point(p: dict, streams: int, tokens_each: int, step_ms: float, roles: set[str]) -> None:
    # --seconds 0: each stream sends exactly one request, of a fixed length (ignore_eos, min_tokens).
    assert p["streams"] == streams and p["errors"] == 0
    assert p["requests"] == streams and p["tokens"] == streams * tokens_each
    assert p["ideal_tokens_per_s"] == streams * 1000 / step_ms and p["share_of_ideal"] > 0
    # CPU time in /proc counts in clock ticks (10 ms): a process can show none over one short request.
    assert set(p["cpu_us_per_token"]) == roles | {"mesh"} and min(p["cpu_us_per_token"].values()) >= 0
    assert p["cpu_us_per_token"]["mesh"] == pytest.approx(sum(p["cpu_us_per_token"][r] for r in roles))
    assert p["client_cpu_us_per_token"] > 0 and p["ttft_ms_p50"] > 0
    st = p["decode_steps"]
    assert st["steps"] > 0 and st["step_ms_p50"] > 0 and st["host_ms_p50"] >= 0
    assert {"host_exposed_ms_p50", "host_hidden_share"} <= set(st)


def test_stream_with_the_mock_engine(tmp_path, tiny_model):
    res, out = bench(tmp_path, tiny_model, "stream", "--model", tiny_model, "--streams", "4", "--seconds", "0",
                     "--osl", "8", "--mock-step-ms", "5", "--warmup-seconds", "0")
    assert "share" in out and "goal" in out
    [p] = res["points"]
    _check_overhead_point(p, 4, 8, 5.0, {"gateway", "prefill", "decode", "nats"})
    assert p["goal"] == "-" and res["goal"]["share_of_ideal_min"] == 0.94
    # Where the first tokens' time went, from the workers' phase rows (tracing is off).
    assert "request phases" in out and "hand-off" in out
    ph = p["request_phases"]
    assert ph["prefill"]["requests"] >= 1 and ph["prefill"]["queue"]["p50"] >= 0
    assert ph["decode"]["handoff"]["p50"] > 0 and ph["decode"]["handoff_steps"]["p90"] > 0


def test_decode_on_the_mock_engine(tmp_path, tiny_model):
    res, out = bench(tmp_path, tiny_model, "decode", "--model", tiny_model, "--mock-step-ms", "5", "--batch", "4",
                     "--isl", "32", "--osl", "8", "--seconds", "0")
    assert res["bench"] == "decode" and res["mode"] == "mock" and "forward_only" not in res
    [p] = res["runs"][0]["points"]
    assert p["batch"] == 4
    # Decode-only bench jobs take the prompt's last token as the prefill's output: osl - 1 are streamed.
    _check_overhead_point(p, 4, 8 - 1, 5.0, {"gateway", "decode", "nats"})


@pytest.mark.slow  # a whole mesh for a bench tool's smoke run: -m slow
def test_idle_measures_every_process_in_both_states(tmp_path, tiny_model):
    res, out = bench(tmp_path, tiny_model, "idle", "--model", tiny_model, "--mock-step-ms", "0", "--seconds", "0.5",
                     "--settle-seconds", "0.2")
    assert [p["state"] for p in res["points"]] == ["idle", "transfer pending"]
    for p in res["points"]:
        assert set(p["core_share"]) == {"gateway", "prefill", "decode", "nats"}
        assert all(v >= 0 for v in p["core_share"].values())
    assert "transfer pending" in out


@pytest.mark.slow  # a whole mesh for a bench tool's smoke run: -m slow
def test_eplb_on_a_live_dep2_instance(tmp_path, tiny_model):
    res, out = bench(tmp_path, tiny_model, "eplb", "--model", tiny_model, "--warmup-s", "5", "--window-s", "3",
                     "--rebalances", "1", "--concurrency", "4", "--max-tokens", "16")
    assert [p["phase"] for p in res["phases"]] == ["naive", "after rebalance 1"]
    assert res["moves"][0]["ok"] and res["moves"][0]["policy_ms"] > 0
    assert {"target", "draft"} <= set(res["phases"][0]["ratio"])
    assert set(res["decode_step_times"]) == {"before", "during", "after"}
    # The naive window's loads, for `moemesh plan --skew file:`: tiny has 2 MoE layers and an MTP one.
    loads = res["phases"][0]["loads"]
    assert len(loads["target"]) == 2 and len(loads["draft"]) == 1 and len(loads["target"][0]) == 16
    assert sum(map(sum, loads["target"])) > 0


@pytest.mark.slow  # a whole mesh for a bench tool's smoke run: -m slow
def test_plan_check_predicts_each_run(tmp_path, tiny_model):
    res, out = bench(tmp_path, tiny_model, "plan-check", "--model", tiny_model, "--deps", "1,2", "--batch", "4",
                     "--isl", "32", "--osl", "8", "--mock-step-ms", "5", "--mock-batches", "4",
                     "--mock-seconds", "0", "--repeats", "1", "--waves", "1", "--collective-calls", "20",
                     timeout=420)
    rows = {r["case"]: r for r in res["comparison"]["rows"]}
    assert set(rows) == {"mock 5ms b4", "DEP1 balanced", "DEP2 balanced", "DEP2 skewed"}
    assert res["comparison"]["fitted_on"] == ["DEP1 balanced", "DEP2 balanced"]
    assert all(r["measured_tps"] > 0 and r["predicted_tps"] > 0 for r in rows.values())
    assert rows["DEP2 skewed"]["measured_wait_ms"] > 0 and "holds" in out
    assert set(res["collectives"]) == {"2"} and res["comparison"]["fitted"]["all_to_all_ms"]["2"] > 0
    # The result plans this host, its collectives and fitted figures included.
    plan = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "moemesh.tools.cli.main", "plan", "--model", tiny_model, "--hardware",
                        "this-host", "--forward", str(tmp_path / "r.json"), "--gpus", "2", "--workload",
                        "fixed:32:8", "--draft-skew", "", "--steps", "4", "--prefill-tokens", "64", "--decode-batch",
                        "2", "--out", str(plan)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    two = next(x for x in json.loads(plan.read_text())["decode"] if x["width"] == 2)
    assert two["a2a_s"] > 2 * 4 * res["collectives"]["2"]["all_to_all_ms"] / 1e3


@pytest.mark.slow  # a whole mesh for a bench tool's smoke run: -m slow
def test_kv_reuse(tmp_path, tiny_model):
    res, out = bench(tmp_path, tiny_model, "kv-reuse", "--model", tiny_model, "--sessions", "2", "--turns", "2",
                     "--context-tokens", "200", "--tool-tokens", "40", "--osl", "4", "--concurrency", "2")
    assert res["with_reuse"]["errors"] == 0 and res["without_reuse"]["errors"] == 0
    assert res["with_reuse"]["prefix_hit_tokens"] > 0 and res["without_reuse"]["prefix_hit_tokens"] == 0
    assert res["turn2plus_ttft_speedup"] is not None


def test_kv_reuse_fits_its_default_context_to_the_model_and_refuses_one_that_does_not_fit(tmp_path, tiny_model):
    from moemesh.tools.bench.kv_reuse import KVReuseBenchConfig, fit_context

    cfg = KVReuseBenchConfig(turns=4, tool_tokens=512, osl=64)
    assert fit_context(cfg, 4096).context_tokens == 4096 - 4 * (512 + 64) - 256
    assert fit_context(cfg, 1 << 16).context_tokens == 8192
    with pytest.raises(ValueError, match="overflow"):
        fit_context(replace(cfg, turns=8), 4096)
    env = dict(os.environ, MOEMESH_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-m", "moemesh.tools.cli.main", "bench", "kv-reuse", "--model", tiny_model,
                        "--context-tokens", "8192", "--out", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "at most 1536" in r.stderr and "Traceback" not in r.stderr


def test_gateway_start_without_torch(tmp_path, tiny_model):
    res, out = bench(tmp_path, tiny_model, "gateway-start", "--model", tiny_model, "--runs", "1")
    assert res["torch_loaded"] is False and "torch loaded: no" in out
    # Both are timed, in separate processes: that a start outlasts an import holds on
    # average, not for one run of each on a busy machine (seen: 0.35 s against 0.32).
    assert res["import_s"] > 0 and res["start_s"] > 0 and res["rss_mib"] > 0


def test_stream_with_mock_drafts_sets_the_draft_head_and_raises_the_ideal():
    from moemesh.tools.bench import overhead, stream

    cfg = stream.StreamBenchConfig(streams=(64,), spec_tokens=2, accept_rate=0.5)
    assert cfg.tokens_per_step == 1.75  # 1 + A + A^2
    sets = stream.worker_settings(64, 256, 20.0, cfg.spec_tokens, cfg.accept_rate)
    assert "num_speculative_tokens=2" in sets and "mock_accept_rate=0.5" in sets
    assert not any(s.startswith(("num_speculative_tokens", "mock_accept_rate"))
                   for s in stream.worker_settings(64, 256, 20.0))
    res = {"tokens": 5600, "cpu_s": {}, "streams": 64, "wall_s": 1.0, "requests": 64, "errors": 0, "error_kinds": {},
           "tokens_per_s": 5600.0, "ttft_ms_p50": 1.0, "ttft_ms_p99": 2.0, "client_cpu_s": 0.1,
           "started_at": 0.0, "ended_at": 1.0}
    row = overhead.point_row(res, 20.0, overhead.MESH_ROLES, [], cfg.tokens_per_step)
    assert row["ideal_tokens_per_s"] == 64 * 1.75 * 50 and row["share_of_ideal"] == 1.0
    with pytest.raises(ValueError):
        stream.StreamBenchConfig(spec_tokens=9)


def test_decode_on_the_mock_with_drafts_sets_the_draft_head_only_when_asked(tiny_model):
    from moemesh.tools.bench import decode_mock

    plain = decode_mock._mesh(decode_mock.MockDecodeConfig(model=tiny_model, batches=(4,))).cfg.decode_args
    assert "num_speculative_tokens=0" in plain and not any(a.startswith("mock_accept_rate") for a in plain)
    cfg = decode_mock.MockDecodeConfig(model=tiny_model, batches=(4,), spec_tokens=1, accept_rate=0.7)
    assert cfg.tokens_per_step == 1.7
    args = decode_mock._mesh(cfg).cfg.decode_args
    assert "num_speculative_tokens=1" in args and "mock_accept_rate=0.7" in args


def test_the_dep_flags_of_the_mock_benches_are_checked_and_reach_the_ranks(tiny_model):
    from moemesh.tools.bench import decode_mock, overhead, stream

    for bad in ({"skew": "zipf:1.2"}, {"rebalance": True}, {"dep": 0}):
        with pytest.raises(ValueError):
            stream.StreamBenchConfig(**bad)
    with pytest.raises(ValueError):
        decode_mock.MockDecodeConfig(skew="zipf:1.2")
    mesh = decode_mock._mesh(decode_mock.MockDecodeConfig(model=tiny_model, batches=(4,), dep=2, skew="zipf:1.2"))
    assert mesh.cfg.decode_dp == 2 and "skew=zipf:1.2" in mesh.cfg.decode_args
    # A point's rank wait, and the part beyond the slowest rank's own step (its 10th column).
    rows = [[1.0, 0.03, 0.02, 0.001, 0.008, 0.0, 16, 0.001, 4, 0.006]] * 3
    fig = overhead.step_figures(rows, 0.0, 2.0)
    assert fig["rank_wait_ms_p50"] == pytest.approx(8.0) and fig["rank_wait_beyond_ms_p50"] == pytest.approx(2.0)
    assert overhead.step_figures([r[:9] for r in rows], 0.0, 2.0)["rank_wait_beyond_ms_p50"] is None
    # The step the device set (own 20 ms + the busiest rank's 6 more) bounds the point: at
    # 20 ms steps a 26 ms device step allows 20/26 of the ideal, of which the point served half.
    assert fig["device_step_ms_mean"] == pytest.approx(26.0)
    res = {"tokens": 1000, "cpu_s": {}, "streams": 64, "wall_s": 1.0, "requests": 64, "errors": 0,
           "error_kinds": {}, "tokens_per_s": 3200 * 20 / 26 / 2, "ttft_ms_p50": 1.0, "ttft_ms_p99": 2.0,
           "client_cpu_s": 0.1, "started_at": 0.0, "ended_at": 2.0}
    row = overhead.point_row(res, 20.0, overhead.MESH_ROLES, rows, balance_ratio=0.9)
    assert row["routing_bound_tokens_per_s"] == pytest.approx(3200 * 20 / 26)
    assert row["share_of_routing_bound"] == pytest.approx(0.5)
    assert "0.769  0.500" in overhead.table([row], overhead.MESH_ROLES).splitlines()[1]
