"""Our policy, node-aware: for DEP across nodes, where all-to-all is fast within a node
(one NVLink domain) and slow between nodes.

DeepSeek-V3 routes each token to experts in at most a few of its G expert groups. If
every group sits whole on one node, a token's experts span few nodes, and much of the
dispatch and combine stays on NVLink. So:

1. groups onto nodes: each node takes G / N whole groups, the node loads as even as
   possible. This is our slot packing (packing.py) with groups for slots and nodes for
   ranks: greedy rounds, then pair exchanges, where DeepSeek packs greedily only;
2. within each node: our policy (policy.py) over that node's E / N experts and R / N
   ranks, with the same K redundant slots per rank, so replicas stay in their node.

Every layer of every node is one row of step 2's batch, so it is vectorised as before.
A node carrying a hot group cannot shed it: balance is bounded by the heaviest node's
load over its ranks, which is the price of keeping traffic inside nodes.

Shapes: L = layers, E = experts, G = groups, N = nodes, R = ranks, P = slots per layer.
"""

from __future__ import annotations

import torch

from moemesh.shared.eplb.expected import NextWindow
from moemesh.shared.eplb.packing import pack
from moemesh.shared.eplb.placement import Placement
from moemesh.shared.eplb.policy import build_placement


def build_hierarchical(loads: torch.Tensor, num_ranks: int, num_redundant: int, *, num_nodes: int,
                       num_groups: int, num_rounds: int | None = None,
                       next_window: NextWindow | None = NextWindow()) -> Placement:
    """Our policy with expert groups kept within nodes.

    Args:
        loads: [L, E] tokens per logical expert; group g is experts g*E/G .. (g+1)*E/G - 1.
        num_ranks: R, a multiple of num_nodes; node n holds ranks n*R/N .. (n+1)*R/N - 1.
        num_redundant: K redundant slots per rank.
        num_nodes: N.
        num_groups: G, a multiple of N, dividing E.
        num_rounds, next_window: as build_placement; the next-window choice is made
            per (layer, node) against DeepSeek's placement within the node.
    Returns:
        The placement; every expert's replicas lie on the node that holds its group.
    """
    if loads.dim() != 2:
        raise ValueError(f"loads must be [layers, experts], got {tuple(loads.shape)}")
    num_layers, num_experts = loads.shape
    if num_nodes < 1 or num_groups < 1 or num_ranks % num_nodes or num_groups % num_nodes \
            or num_experts % num_groups:
        raise ValueError(f"need R % N == G % N == E % G == 0, got R={num_ranks} N={num_nodes} "
                         f"G={num_groups} E={num_experts}")
    w = loads.double()
    group_size = num_experts // num_groups
    group_load = w.view(num_layers, num_groups, group_size).sum(-1)  # [L, G]
    groups = torch.arange(num_groups).expand(num_layers, -1)
    by_node = pack(group_load, groups, num_nodes) if num_nodes > 1 else groups  # [L, G] node-major
    node_experts = (by_node.unsqueeze(-1) * group_size + torch.arange(group_size)).reshape(
        num_layers * num_nodes, num_experts // num_nodes)  # [L*N, E/N]
    node_loads = w.gather(1, node_experts.view(num_layers, -1)).view_as(node_experts)
    kw = {} if num_rounds is None else {"num_rounds": num_rounds}
    local = build_placement(node_loads, num_ranks // num_nodes, num_redundant, next_window=next_window,
                            **kw)  # [L*N, P/N]
    phy2log = node_experts.gather(1, local.phy2log).view(num_layers, -1)
    return Placement(phy2log, num_experts, num_ranks)
