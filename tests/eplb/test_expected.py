import pytest
import torch

from moemesh.shared.eplb import expected, reference
from moemesh.shared.eplb.expected import NextWindow
from moemesh.shared.eplb.grid import workload
from moemesh.shared.eplb.placement import Placement, naive_placement
from moemesh.shared.eplb.policy import build_placement, deepseek_like


def test_copies_spread_as_sampling_plus_drift():
    loads = torch.tensor([[0.0, 100.0, 10_000.0, 1_000_000.0]], dtype=torch.float64)
    model = NextWindow(drift=0.05, num_samples=4000)
    s = expected.sample_next(loads, model).double()
    assert s.shape == (4000, 1, 4) and bool((s >= 0).all())
    assert bool((s[:, 0, 0] == 0).all())  # an expert that saw nothing stays at nothing
    w = loads[0, 1:]
    assert s[:, 0, 1:].mean(0) == pytest.approx(w, rel=0.02)
    assert s[:, 0, 1:].var(0) == pytest.approx(2 * w + (0.05 * w) ** 2, rel=0.1)
    assert torch.equal(expected.sample_next(loads, model), expected.sample_next(loads, model))


def test_peaks_are_the_placements_max_rank_loads():
    w = workload("zipf:0.9", 32, 3, seed=2).windows(1)[0].double()
    p = build_placement(w, 4, 1, next_window=None)
    s = expected.sample_next(w, NextWindow(num_samples=5))
    want = torch.stack([p.rank_loads(s[i].double()).amax(1) for i in range(5)])
    assert expected.peak_loads(s, p.phy2log, 4).double() == pytest.approx(want, rel=1e-5)


def test_choice_keeps_the_default_unless_the_other_is_clearly_better():
    w = workload("zipf:0.9", 64, 4, seed=2).windows(1)[0].double()
    naive = naive_placement(4, 64, 8, 1).phy2log
    good = build_placement(w, 8, 1, next_window=None).phy2log
    assert expected.better_layers(w, naive, good, 8).tolist() == [True] * 4
    assert expected.better_layers(w, good, naive, 8).tolist() == [False] * 4
    assert expected.better_layers(w, good, good.clone(), 8).tolist() == [False] * 4  # a tie keeps the default
    assert expected.better_layers(w, naive, good, 8, NextWindow(caution=1e9)).tolist() == [False] * 4


def test_a_layer_expected_to_lose_is_never_taken_along():
    w = workload("zipf:0.9", 64, 2, seed=2).windows(1)[0].double()
    good = build_placement(w, 8, 1, next_window=None).phy2log
    naive = naive_placement(2, 64, 8, 1).phy2log
    default = torch.stack([naive[0], good[1]])
    alternative = torch.stack([good[0], naive[1]])
    assert expected.better_layers(w, default, alternative, 8).tolist() == [True, False]


@pytest.mark.parametrize("skew, redundant", [("zipf:0.69", 1), ("zipf:1.2", 2), ("hot:4:0.4", 0), ("hot:1:0.1", 2)])
def test_deepseek_like_is_deepseek(skew, redundant):
    w = workload(skew, 128, 6, seed=2).windows(2).double()
    ours = Placement(deepseek_like(w[0], 16, 128 // 16 + redundant), 128, 16)
    theirs = reference.rebalance(w[0], 16, redundant)
    # The same slots on the same ranks, duplicates included (zipf:1.2 and hot:1 have
    # them): not a placement that merely ties on the window it was built from.
    assert torch.equal(ours.phy2log.view(6, 16, -1).sort(-1).values, theirs.phy2log.view(6, 16, -1).sort(-1).values)


def test_each_layer_is_ours_or_deepseeks():
    w = workload("hot:4:0.4", 128, 8, seed=2).windows(1)[0].double()
    chosen = build_placement(w, 32, 1).phy2log
    ours = build_placement(w, 32, 1, next_window=None).phy2log
    theirs = deepseek_like(w, 32, 5)
    is_ours, is_theirs = (chosen == ours).all(1), (chosen == theirs).all(1)
    assert bool((is_ours | is_theirs).all())
    assert bool(is_ours.any())  # 4 hot experts with 40%: D'Hondt's counts do not pack
