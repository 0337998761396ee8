import torch

from moemesh.shared.eplb.reference import rebalance, rebalance_slots


def test_matches_upstream_readme_example():
    # The worked example of github.com/deepseek-ai/EPLB's README (hierarchical, 2 nodes).
    w = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                      [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    p = rebalance_slots(w, 16, 8, num_nodes=2, num_groups=4)
    assert p.phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert p.replica_counts().tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                                           [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]


def test_hierarchical_keeps_each_group_on_one_node():
    g = torch.Generator().manual_seed(1)
    w = torch.rand(3, 64, generator=g) * 100
    p = rebalance(w, num_ranks=8, num_redundant=1, num_nodes=4, num_groups=8)
    node_of_slot = torch.arange(p.num_slots) // (p.num_slots // 4)
    for layer in range(3):
        for group in range(8):
            nodes = node_of_slot[(p.phy2log[layer] // 8) == group].unique()
            assert len(nodes) == 1
