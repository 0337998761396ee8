import pytest
import torch

from moemesh.shared.eplb.align import align, moves_per_layer
from moemesh.shared.eplb.placement import Placement
from moemesh.shared.eplb.policy import build_placement
from moemesh.shared.eplb.reference import rebalance
from moemesh.shared.eplb.workloads import Workload

SMALL = Workload(num_layers=4, num_experts=64, tokens_per_window=8192)


def _scramble(p: Placement, seed: int) -> Placement:
    """Same placement with ranks relabelled and each rank's slots shuffled."""
    g = torch.Generator().manual_seed(seed)
    ranks = p.phy2log.view(p.num_layers, p.num_ranks, -1)
    out = torch.stack([ranks[l][torch.randperm(p.num_ranks, generator=g)] for l in range(p.num_layers)])
    out = torch.stack([torch.stack([r[torch.randperm(r.numel(), generator=g)] for r in layer]) for layer in out])
    return Placement(out.flatten(1), p.num_experts, p.num_ranks)


def test_identical_loads_move_nothing():
    loads = SMALL.windows(1)[0]
    a = build_placement(loads, 8, 1)
    b = build_placement(loads.clone(), 8, 1)
    assert moves_per_layer(a, align(a, b)).tolist() == [0] * 4


def test_relabelled_ranks_and_shuffled_slots_are_undone():
    loads = SMALL.windows(1)[0]
    a = build_placement(loads, 8, 1)
    scrambled = _scramble(a, 0)
    assert int(moves_per_layer(a, scrambled).sum()) > 0
    assert int(moves_per_layer(a, align(a, scrambled)).sum()) == 0


def test_alignment_keeps_balance_and_cuts_moves():
    w = SMALL.windows(3).double()
    a, b = build_placement(w[0], 8, 1), build_placement(w[1], 8, 1)
    aligned = align(a, b)
    # Same per-rank experts up to relabelling, so the same load on every rank, any window.
    assert torch.allclose(aligned.rank_loads(w[2]).sort(1).values, b.rank_loads(w[2]).sort(1).values)
    assert bool((moves_per_layer(a, aligned) <= moves_per_layer(a, b)).all())
    assert int(moves_per_layer(a, aligned).sum()) < int(moves_per_layer(a, b).sum())


def test_experts_staying_on_a_rank_keep_their_slot():
    current = Placement(torch.tensor([[0, 1, 2, 3, 4, 5]]), num_experts=6, num_ranks=2)
    new = Placement(torch.tensor([[5, 4, 0, 2, 3, 1]]), num_experts=6, num_ranks=2)
    out = align(current, new)
    # New rank {5, 4, 0} matches old rank {3, 4, 5} best: 4 and 5 stay put, 0 takes 3's
    # slot; new rank {2, 3, 1} takes over old rank {0, 1, 2}, and 3 takes 0's slot.
    assert out.phy2log.tolist() == [[3, 1, 2, 0, 4, 5]]
    assert moves_per_layer(current, out).tolist() == [2]


def test_hierarchical_ranks_stay_in_their_node():
    w = torch.rand(2, 64, generator=torch.Generator().manual_seed(3)) * 100
    a = rebalance(w, 8, 1, num_nodes=2, num_groups=8)
    b = rebalance(w.flip(1), 8, 1, num_nodes=2, num_groups=8)
    out = align(a, b, num_nodes=2)
    half = out.num_slots // 2
    for layer in range(2):
        assert sorted(out.phy2log[layer, :half].tolist()) == sorted(b.phy2log[layer, :half].tolist())


def test_incompatible_placements_are_rejected():
    a = Placement(torch.tensor([[0, 1, 2, 3]]), 4, 2)
    with pytest.raises(ValueError, match="differ"):
        align(a, Placement(torch.tensor([[0, 1, 2, 3]]), 4, 4))
