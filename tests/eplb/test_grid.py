import pytest

from moemesh.shared.eplb import reference
from moemesh.shared.eplb.grid import GridConfig, run_grid, table, workload
from moemesh.shared.eplb.policy import build_placement
from moemesh.shared.eplb.replicas import choose_counts

# A small version of the 252-scenario grid of `moemesh eplb compare --grid`: every skew,
# the two smaller expert counts, and the rank counts where the two policies differ most.
SMALL = GridConfig(experts=(64, 128), ranks=(4, 8, 32), num_layers=3, num_pairs=1, seed=2)


def test_ours_at_least_deepseek_on_every_scenario_held_out():
    result = run_grid(SMALL)
    assert result["summary"]["scenarios"] == 7 * 2 * 3 * 3
    behind = [r for r in result["rows"] if r["gain"] < 0]
    assert not behind, table({"rows": behind, "summary": result["summary"]})


def test_many_slots_per_rank_without_redundancy_reaches_deepseek():
    # Zipf 1.2, 256 experts over 4 ranks, K = 0: 64 slots per rank. Rounds then 24 swap
    # rounds left it at 0.881 against DeepSeek's 0.900; the greedy start closes that.
    windows = workload("zipf:1.2", 256, 4, seed=3).windows(2).double()
    ours = build_placement(windows[0], 4, 0)
    theirs = reference.rebalance(windows[0], 4, 0)
    assert ours.instance_ratio(windows[0]) >= theirs.instance_ratio(windows[0]) - 1e-12
    assert ours.instance_ratio(windows[1]) >= theirs.instance_ratio(windows[1])


@pytest.mark.parametrize("num_experts", [64, 256])
def test_hot_experts_on_many_ranks_reach_their_bound(num_experts):
    # 4 hot experts with 40% of tokens, 32 ranks, K = 1: the swaps stalled at 0.97-0.98
    # in-window while the chosen counts' bound allowed about 1.0.
    loads = workload("hot:4:0.4", num_experts, 4, seed=3).windows(1)[0].double()
    p = build_placement(loads, 32, 1)
    _, bound = choose_counts(loads, 32, num_experts // 32 + 1)
    assert bool((p.layer_ratios(loads) >= 0.995 / bound).all())
