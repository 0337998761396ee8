import json

import pytest
import torch

from moemesh.shared.eplb.placement import Placement, instance_ratio, layer_ratios, naive_placement, route_to_slots


def test_naive_is_contiguous_and_redundant_slots_repeat_own_experts():
    p = naive_placement(num_layers=2, num_experts=8, num_ranks=4, num_redundant=1)
    assert p.slots_per_rank == 3 and p.num_redundant == 1
    assert p.phy2log[0].view(4, 3).tolist() == [[0, 1, 0], [2, 3, 2], [4, 5, 4], [6, 7, 6]]
    loads = torch.tensor([[1.0, 2, 3, 4, 5, 6, 7, 8]] * 2)
    # Repeating a rank's own expert splits its load within the rank: rank loads are unchanged.
    assert p.rank_loads(loads)[0].tolist() == [3, 7, 11, 15]


def test_round_robin_deals_experts_over_ranks_and_spreads_every_group():
    p = naive_placement(num_layers=1, num_experts=16, num_ranks=4, num_redundant=1, strategy="round_robin")
    assert p.phy2log[0].view(4, 5).tolist() == [[0, 4, 8, 12, 0], [1, 5, 9, 13, 1], [2, 6, 10, 14, 2],
                                                 [3, 7, 11, 15, 3]]
    # 4 groups of 4 consecutive experts (DeepSeek's grouped router): linear puts a group on
    # one rank, round_robin one expert of each group on every rank.
    group_ranks = {"linear": set(), "round_robin": set()}
    for strategy in group_ranks:
        rank_of = naive_placement(1, 16, 4, 0, strategy).phy2log[0].argsort() // 4  # expert -> rank
        group_ranks[strategy] = {len(set(rank_of[g * 4:(g + 1) * 4].tolist())) for g in range(4)}
    assert group_ranks == {"linear": {1}, "round_robin": {4}}
    with pytest.raises(ValueError, match="round_robin"):
        naive_placement(1, 16, 4, 0, "striped")


def test_rank_loads_split_an_expert_evenly_over_its_replicas():
    p = Placement(torch.tensor([[0, 1, 0, 2]]), num_experts=3, num_ranks=2)
    loads = torch.tensor([[10.0, 4.0, 6.0]])
    assert p.replica_counts().tolist() == [[2, 1, 1]]
    assert p.rank_loads(loads).tolist() == [[9.0, 11.0]]
    assert p.layer_ratios(loads).tolist() == pytest.approx([10 / 11])


def test_instance_ratio_weights_layers_by_load():
    ranks = torch.tensor([[1.0, 1.0], [10.0, 30.0]])
    assert instance_ratio(ranks) == pytest.approx((1 + 20) / (1 + 30))
    assert layer_ratios(torch.zeros(1, 4)).tolist() == [1.0]  # idle layer counts as balanced


def test_log2phy_lists_every_slot_of_every_expert_once():
    g = torch.Generator().manual_seed(0)
    rows = [torch.cat([torch.arange(6), torch.randint(0, 6, (6,), generator=g)]) for _ in range(3)]
    phy2log = torch.stack([r[torch.randperm(12, generator=g)] for r in rows])
    p = Placement(phy2log, num_experts=6, num_ranks=4)
    table, counts = p.log2phy(), p.replica_counts()
    for layer in range(3):
        for e in range(6):
            slots = table[layer, e]
            real = slots[slots >= 0]
            assert len(real) == counts[layer, e]
            assert sorted(real.tolist()) == (phy2log[layer] == e).nonzero().flatten().tolist()
            assert bool((slots[len(real):] == -1).all())


def test_route_to_slots_splits_a_batch_evenly_over_replicas():
    p = Placement(torch.tensor([[0, 1, 0, 0]]), num_experts=2, num_ranks=2)
    ids = torch.zeros(9, 1, dtype=torch.long)  # nine tokens, all to expert 0 (3 replicas)
    slots = route_to_slots(p.log2phy()[0], p.replica_counts()[0], ids)
    assert torch.bincount(slots.flatten(), minlength=4).tolist() == [3, 0, 3, 3]


def test_json_round_trip_and_rejections():
    p = naive_placement(3, 16, 4, 2)
    back = Placement.from_json(json.loads(json.dumps(p.to_json(compute_ms=1.5))))
    assert torch.equal(back.phy2log, p.phy2log) and back.num_ranks == 4 and back.num_experts == 16
    with pytest.raises(ValueError, match="format"):
        Placement.from_json({"layers": [[[0]]]})
    with pytest.raises(ValueError, match="no replica"):
        Placement(torch.tensor([[0, 0, 1, 1]]), num_experts=3, num_ranks=2)
    with pytest.raises(ValueError, match="split"):
        Placement(torch.tensor([[0, 1, 2]]), num_experts=3, num_ranks=2)
