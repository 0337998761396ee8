import pytest
import torch

from moemesh.shared.eplb import reference
from moemesh.shared.eplb.grid import GridConfig, run_grid, table, workload
from moemesh.shared.eplb.policy import build_placement

# The 252-scenario grid of `moemesh eplb compare --grid` with fewer layers, on a seed
# the policy was not tuned on (1 and 2 were).
SMALL = GridConfig(num_layers=6, num_pairs=2, seed=3)


@pytest.mark.slow  # all 252 scenarios, a benchmark's run (moemesh eplb compare --grid); the policy has its own tests
def test_ours_against_deepseek_on_every_scenario():
    result = run_grid(SMALL)
    rows = result["rows"]
    assert result["summary"]["scenarios"] == 252
    # In-window (what a policy optimises, no noise) ours is never behind by more than
    # its stopping rule lets it be: swaps stop once every rank is within mean / 0.999.
    short = [r for r in rows if r["ours_in_window"] < r["deepseek_in_window"] - 1e-3]
    assert not short, table({"rows": short, "summary": result["summary"]})
    # Held out, never behind: a layer keeps DeepSeek's exact placement unless the
    # next-window copies make ours clearly better for the instance (expected.py), so a
    # scenario ties exactly or gains (docs/eplb.md: 0 of 252 behind on seeds 1, 2 and 3).
    assert result["summary"]["mean_gain"] > 0.004
    behind = [r for r in rows if r["gain"] < -1e-9]
    assert not behind, table({"rows": behind, "summary": result["summary"]})


def test_many_slots_per_rank_without_redundancy_reaches_deepseek():
    # Zipf 1.2, 256 experts over 4 ranks, K = 0: 64 slots per rank. Rounds then 24 swap
    # rounds left it at 0.881 against DeepSeek's 0.900; the greedy start closes that.
    windows = workload("zipf:1.2", 256, 4, seed=3).windows(2).double()
    ours = build_placement(windows[0], 4, 0)
    theirs = reference.rebalance(windows[0], 4, 0)
    assert ours.instance_ratio(windows[0]) >= theirs.instance_ratio(windows[0]) - 1e-12
    # Both reach the hottest experts' floor in-window; held out they differ by noise only.
    assert ours.instance_ratio(windows[1]) >= theirs.instance_ratio(windows[1]) - 1e-3
    capped = build_placement(windows[0], 4, 0, num_rounds=24)  # the default cap, still
    assert capped.instance_ratio(windows[0]) >= theirs.instance_ratio(windows[0]) - 1e-12


@pytest.mark.parametrize("num_experts", [64, 256])
def test_hot_experts_on_many_ranks_beat_deepseek_held_out(num_experts):
    # 4 hot experts with 40% of tokens, 32 ranks, K = 1. At 64 experts (3 slots per rank)
    # the swaps stop at 0.987-0.995 in-window under a bound of 0.999; packing other
    # counts gets 0.996 in-window but loses held out, so the plateau stays (docs/eplb.md).
    windows = workload("hot:4:0.4", num_experts, 6, seed=3).windows(2).double()
    ours = build_placement(windows[0], 32, 1, next_window=None)
    theirs = reference.rebalance(windows[0], 32, 1)
    assert ours.instance_ratio(windows[0]) > 0.99
    assert ours.instance_ratio(windows[1]) > theirs.instance_ratio(windows[1]) + 0.005
    # The next-window choice takes ours at 256 experts. At 64 the copies expect ours to
    # gain ~1% of a layer's max with a spread of ~2%, too doubtful at caution 2, so it
    # keeps DeepSeek's (this pair of windows happens to favour ours by 0.023).
    chosen = build_placement(windows[0], 32, 1)
    assert chosen.instance_ratio(windows[1]) >= theirs.instance_ratio(windows[1])
    if num_experts == 256:
        assert torch.equal(chosen.phy2log, ours.phy2log)


def test_cli_default_skews_are_the_grid_s():
    # The CLI keeps its own copy so that `--help` does not import torch.
    from moemesh.shared.eplb.grid import SKEWS
    from moemesh.tools.cli.cmd_eplb import SKEWS as CLI_SKEWS

    assert CLI_SKEWS == SKEWS
