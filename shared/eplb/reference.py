"""DeepSeek's published EPLB algorithm, rewritten here to compare against ours.

Source of the algorithm: github.com/deepseek-ai/EPLB (eplb.py), also used by vLLM
(vllm/distributed/eplb/rebalance_algo.py). This is an independent rewrite of the same
three steps, kept faithful to their choices, including the per-layer Python packing
loop, because its speed is part of what we compare:

1. hierarchical only: pack the expert groups (DeepSeek-V3 routes within a few of 8
   groups) onto nodes, equal group counts per node, greedily heaviest first;
2. within each node, hand out the node's slots as replicas: each extra slot goes to
   the expert whose per-replica load is then largest (D'Hondt apportionment);
3. within each node, pack the slots onto ranks, S per rank, heaviest first into the
   lightest rank that still has room.

Global mode is the one-node, one-group case. Replicas of one expert may share a rank.

Shapes: L = layers, E = experts, G = groups, N = nodes, R = ranks, S = slots per rank.
"""

from __future__ import annotations

import torch

from moemesh.shared.eplb.placement import Placement, slots_per_rank


def rebalance(loads: torch.Tensor, num_ranks: int, num_redundant: int, *, num_nodes: int = 1,
              num_groups: int = 1) -> Placement:
    """DeepSeek EPLB on loads [L, E]: hierarchical when num_nodes > 1, else global.

    Args:
        loads: [L, E] tokens per logical expert.
        num_ranks: R, a multiple of num_nodes.
        num_redundant: K redundant slots per rank.
        num_nodes: N; 1 gives the global policy.
        num_groups: G expert groups (8 for DeepSeek-V3), a multiple of num_nodes.
    Returns:
        The placement; slots are numbered rank-major.
    """
    per_rank = slots_per_rank(loads.shape[1], num_ranks, num_redundant)
    return rebalance_slots(loads, num_ranks * per_rank, num_ranks, num_nodes=num_nodes, num_groups=num_groups)


def rebalance_slots(loads: torch.Tensor, num_slots: int, num_ranks: int, *, num_nodes: int = 1,
                    num_groups: int = 1) -> Placement:
    """As rebalance, with the slot count given directly (upstream's num_replicas)."""
    num_layers, num_experts = loads.shape
    if num_slots % num_ranks or num_slots < num_experts:
        raise ValueError(f"{num_slots} slots must be >= {num_experts} experts and split over {num_ranks} ranks")
    per_rank = num_slots // num_ranks
    if num_ranks % num_nodes or num_groups % num_nodes or num_experts % num_groups or num_experts % num_nodes:
        raise ValueError(f"need R % N == G % N == E % G == 0, got R={num_ranks} N={num_nodes} "
                         f"G={num_groups} E={num_experts}")
    w = loads.float()
    ranks_per_node = num_ranks // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = ranks_per_node * per_rank
    group_size = num_experts // num_groups

    # Step 1: which experts each node holds, [L, N, E/N], groups kept whole.
    group_load = w.view(num_layers, num_groups, group_size).sum(-1)  # [L, G]
    node_of_group, pos_of_group = pack(group_load, num_nodes)
    order = node_of_group * (num_groups // num_nodes) + pos_of_group  # [L, G] place in node-major order
    node_groups = torch.empty_like(order).scatter_(1, order, torch.arange(num_groups).expand_as(order))
    node_experts = (node_groups.unsqueeze(-1) * group_size + torch.arange(group_size)).view(
        num_layers * num_nodes, experts_per_node)  # [L*N, E/N]

    # Step 2: replicas within each node.
    node_loads = w.gather(1, node_experts.view(num_layers, -1)).view(num_layers * num_nodes, -1)
    local_phy2log, counts = replicate(node_loads, slots_per_node)  # [L*N, P/N], [L*N, E/N]

    # Step 3: slots onto the node's ranks.
    slot_load = (node_loads / counts).gather(1, local_phy2log)  # [L*N, P/N]
    rank_of_slot, pos_in_rank = pack(slot_load, ranks_per_node)
    target = rank_of_slot * per_rank + pos_in_rank  # [L*N, P/N] local slot index
    local = torch.empty_like(local_phy2log).scatter_(1, target, local_phy2log)
    phy2log = node_experts.gather(1, local).view(num_layers, -1)
    return Placement(phy2log, num_experts, num_ranks)


def replicate(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives each of n items one slot, then each extra slot to the largest per-slot load.

    Args:
        weight: [X, n] item loads.
        num_slots: total slots per row, >= n.
    Returns:
        phy2log: [X, num_slots], item of each slot: 0..n-1 first, then the extras.
        counts: [X, n] slots per item.
    """
    rows, n = weight.shape
    counts = torch.ones(rows, n, dtype=torch.int64)
    extra = []
    for _ in range(num_slots - n):
        pick = (weight / counts).argmax(-1)  # [X]
        extra.append(pick)
        counts[torch.arange(rows), pick] += 1
    first = torch.arange(n).expand(rows, n)
    return torch.cat([first, *[e.unsqueeze(1) for e in extra]], dim=1), counts


def pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy balanced packing, n/num_packs items per pack, heaviest item first.

    Args:
        weight: [X, n] item weights, n a multiple of num_packs.
        num_packs: number of packs.
    Returns:
        pack_of: [X, n] pack of each item; pos_in_pack: [X, n] its place in that pack.
    """
    rows, n = weight.shape
    capacity = n // num_packs
    if capacity == 1:
        return torch.arange(n).expand(rows, n).clone(), torch.zeros(rows, n, dtype=torch.int64)
    order = weight.sort(-1, descending=True).indices.tolist()
    values = weight.tolist()
    pack_of = [[0] * n for _ in range(rows)]
    pos_in_pack = [[0] * n for _ in range(rows)]
    for row in range(rows):
        totals = [0.0] * num_packs
        filled = [0] * num_packs
        for item in order[row]:
            best = min((p for p in range(num_packs) if filled[p] < capacity), key=totals.__getitem__)
            pack_of[row][item] = best
            pos_in_pack[row][item] = filled[best]
            totals[best] += values[row][item]
            filled[best] += 1
    return torch.tensor(pack_of, dtype=torch.int64), torch.tensor(pos_in_pack, dtype=torch.int64)
