"""A DEP rank's step accounting: the parts of a step partition it."""

from types import SimpleNamespace

import pytest

from moemesh.shared.engine.outputs import StepStats
from moemesh.shared.service.runtime import StepAccounting
from moemesh.shared.telemetry.metrics import Metrics


def _engine(stats: StepStats):
    return SimpleNamespace(last_stats=stats, num_prompt_tokens_total=0, num_cached_tokens_total=0,
                           num_drafted_total=0, num_accepted_total=0)


def test_the_agreement_between_steps_is_rank_wait_not_loop_gap():
    # 10 ms in the engine's step (6 of it the forward, 2 of that in the all-to-all), then
    # 7 ms in the loop before the next one, 5 of which the agreement took.
    stats = StepStats(num_seqs=4, num_tokens=4, forward_s=6e-3, total_s=10e-3)
    acc = StepAccounting(_engine(stats), Metrics(), gap_s=lambda: 7e-3, rank_step=lambda: (2e-3, 5e-3, 0.0))
    acc.on_step()
    a, row = acc.last_account, acc.recent_steps[-1]
    assert a.rank_wait_s == pytest.approx(7e-3) and a.forward_s == pytest.approx(4e-3)
    assert row[5] == pytest.approx(2e-3)  # the loop gap, less the agreement
    # Every millisecond between one step's start and the next's, once.
    assert a.total_s == pytest.approx(10e-3 + 7e-3)


def test_without_lockstep_the_whole_gap_is_the_loop_s():
    stats = StepStats(num_seqs=4, num_tokens=4, forward_s=6e-3, total_s=10e-3)
    acc = StepAccounting(_engine(stats), Metrics(), gap_s=lambda: 1e-3)
    acc.on_step()
    assert acc.recent_steps[-1][5] == pytest.approx(1e-3) and acc.last_account.host_s == pytest.approx(5e-3)


def test_a_step_row_carries_its_accepted_drafts_and_the_bench_reads_the_gain():
    from moemesh.tools.bench.overhead import step_figures

    acc = StepAccounting(_engine(StepStats(num_seqs=4, num_tokens=8, forward_s=6e-3, total_s=10e-3, num_drafted=4,
                                           num_accepted=3)), Metrics(), gap_s=lambda: 0.0)
    acc.on_step()
    row = acc.recent_steps[-1]
    assert row[8] == 3
    fig = step_figures([row, [*row[:6], 4, row[7], 1]], row[0] - 1, row[0] + 1)
    assert fig["tokens_per_seq_step"] == pytest.approx((8 + 4) / 8)  # 8 sequence-steps gained 4 drafts
    assert step_figures([row[:8]], row[0] - 1, row[0] + 1)["tokens_per_seq_step"] is None  # an older worker's row
