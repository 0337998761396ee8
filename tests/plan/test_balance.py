import numpy as np
import pytest

from moemesh.shared.plan import skew as skews
from moemesh.shared.plan.balance import _replica_index, balance


def test_replica_index_counts_each_experts_slots_in_order():
    phy = np.array([[2, 0, 2, 1, 2, 0]])
    assert _replica_index(phy).tolist() == [[0, 0, 1, 0, 2, 1]]


def test_sampled_pairs_are_conserved_and_split_over_replicas():
    sk = skews.parse("zipf:1.0", 3, 32, 4, seed=1)
    b = balance(sk, 4, 1)
    rng = np.random.default_rng(0)
    pairs, active = b.sample(sk.popularity, 1000, 5, rng)
    assert pairs.shape == (5, 3, 4) and active.shape == (5, 3, 4)
    assert np.allclose(pairs.sum(-1), 1000)
    assert (active <= b.placement.slots_per_rank).all() and (active >= 0).all()


def test_eplb_beats_the_naive_placement_held_out():
    sk = skews.parse("zipf:0.69", 8, 64, 8, seed=0)
    b = balance(sk, 8, 1)
    assert b.ratio_naive < 0.8 and b.ratio > b.ratio_naive + 0.1
    off = balance(sk, 8, 1, eplb=False)
    assert off.ratio == off.ratio_naive == pytest.approx(b.ratio_naive)
    one = balance(sk, 1, 1)
    assert one.ratio == one.ratio_naive == 1.0


def test_seed_skews_match_their_calibration():
    # docs/eplb.md: naive 0.335 (zipf) and 0.204 (hot) at 256 experts over 32 ranks.
    z = balance(skews.parse("zipf:0.69", 43, 256, 8), 32, 1, eplb=False)
    h = balance(skews.parse("hot:4:0.42", 43, 256, 8), 32, 1, eplb=False)
    assert z.ratio_naive == pytest.approx(0.335, abs=0.02)
    assert h.ratio_naive == pytest.approx(0.204, abs=0.02)


def test_bad_skew_spelling():
    with pytest.raises(ValueError, match="skew"):
        skews.parse("pareto:2", 2, 8, 2)
    with pytest.raises(ValueError, match="skew"):
        skews.parse("zipf:x", 2, 8, 2)
