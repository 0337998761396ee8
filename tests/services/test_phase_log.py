"""A worker's per-request phase log, and the bench's figures over it."""

from __future__ import annotations

import pytest

from moemesh.shared.service.runtime import PhaseLog
from moemesh.shared.telemetry.metrics import Metrics
from moemesh.tools.bench.request_phases import figures as phase_figures, line


def test_a_phase_log_keeps_rows_for_stats_and_a_histogram_by_phase():
    m = Metrics()
    log = PhaseLog(m, "handoff_phase_seconds", "doc", ("dispatch", "transfer"), max_rows=2)
    for i in range(3):
        log.record(0.001 * i, 0.002)
    assert [row[1:] for row in log.rows] == [[0.001, 0.002], [0.002, 0.002]]  # the oldest went
    assert log.stats_fields(False) == {"request_phases": ["dispatch", "transfer"], "recent_requests": []}
    assert len(log.stats_fields(True)["recent_requests"]) == 2
    body = m.render()[0].decode()
    assert 'moemesh_handoff_phase_seconds_count{phase="transfer"} 3.0' in body
    assert 'moemesh_handoff_phase_seconds_bucket{le="0.0025",phase="transfer"} 3.0' in body
    with pytest.raises(ValueError, match="2 phases"):
        log.record(0.1)


def test_phase_figures_pool_a_roles_workers_over_the_window_and_count_the_handoff_in_steps():
    names = ["dispatch", "transfer", "import", "first_step"]
    dec = [[10.0, 0.001, 0.002, 0.003, 0.005], [11.0, 0.001, 0.002, 0.007, 0.005], [99.0, 1, 1, 1, 1]]
    pre = [[10.5, 0.002, 0.006]]
    fig = phase_figures({"decode-0": (names, dec[:1]), "decode-1": (names, dec[1:]),
                         "prefill-0": (["queue", "prefill"], pre)}, 9.0, 12.0, 5.0)
    assert fig["decode"]["requests"] == 2 and fig["prefill"]["requests"] == 1
    assert fig["decode"]["handoff"]["p50"] == pytest.approx(8.0)  # (6 + 10) / 2 ms
    assert fig["decode"]["handoff_steps"]["p50"] == pytest.approx(1.6)
    assert fig["prefill"]["queue"]["p90"] == pytest.approx(2.0)
    assert "handoff" not in fig["prefill"]
    assert "hand-off 8.0/" in line(fig) and "queue 2.0/" in line(fig)
    assert "handoff_steps" not in phase_figures({"decode-0": (names, dec[:1])}, 9.0, 12.0)["decode"]
    assert phase_figures({"decode-0": (names, dec[2:])}, 9.0, 12.0, 5.0) == {}
