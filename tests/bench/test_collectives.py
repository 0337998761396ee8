"""The collectives' timing between real gloo processes, kept short."""

from moemesh.tools.bench.collectives import time_collectives
from moemesh.tools.bench.plan_check import processors_left


def test_times_each_width_above_one():
    out = time_collectives([1, 2], {1: 4, 2: 2}, top_k=2, hidden=8, calls=5, blocks=2)
    assert set(out) == {2}
    r = out[2]
    assert r["calls"] == 10 and len(r["blocks"]) == 2 and r["all_to_all_ms"] > 0 and r["all_gather_ms"] > 0
    assert 0 < r["all_to_all_ms_p50"] <= r["all_to_all_ms_p90"]
    assert 0 < r["all_gather_ms_p50"] <= r["all_gather_ms_p90"]


def test_processors_left_is_the_machine_less_what_others_took():
    runs = [{"cpu": {"other_cores": x}} for x in (0.0, 1.0, 0.2)] + [{"point": {}}]
    assert processors_left(runs, cpu_count=2) == 1.8
    assert processors_left([], cpu_count=2) == 2.0
    assert processors_left([{"cpu": {"other_cores": 3.0}}], cpu_count=2) == 1.0


def test_the_compute_between_calls_is_not_counted_in_them():
    # 60 ms of forward a step (20 ms before each layer's calls and before the agreement) and
    # 40 ms of host work before the agreement: calls timed with them would take 20 and 60 ms
    # at least; gloo's between two processes take a few ms even on a busy machine.
    r = time_collectives([2], {2: 2}, top_k=2, hidden=8, calls=3, layers=2, forward_s_by_width={2: 60e-3},
                         blocks=1, host_s_by_width={2: 40e-3})[2]
    assert r["wall_s"] > 3 * 0.1 and r["all_to_all_ms_p50"] < 15.0 and r["all_gather_ms_p50"] < 30.0
