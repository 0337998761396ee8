"""Aligning a new placement to the current one, so that applying it moves few weights.

A placement's balance does not change when its ranks are relabelled, or when a rank's
slots are reordered. The live mover copies one expert's weights into every slot whose
expert changes, so before handing a new placement over we:

1. relabel its ranks so each new rank lands on the current rank it shares the most
   experts with (greedy max-overlap matching, then pairwise 2-opt exchanges). With
   nodes > 1 ranks only trade places inside their node, which keeps the node
   structure of a hierarchical placement;
2. inside each rank, leave every expert that stays on that rank in its current slot,
   and put the arriving experts into the freed slots.

Shapes: L = layers, R = ranks, S = slots per rank, E = experts.
"""

from __future__ import annotations

import torch

from moemesh.shared.eplb.placement import Placement


def align(current: Placement, new: Placement, *, num_nodes: int = 1, opt_passes: int = 8) -> Placement:
    """The new placement with ranks relabelled and slots reordered to match `current`.

    Args:
        current: the placement the instance runs now.
        new: the candidate; same layers, experts, ranks and slots per rank.
        num_nodes: ranks are only relabelled within blocks of R / num_nodes ranks.
        opt_passes: most 2-opt passes over the rank matching.
    Returns:
        A placement with exactly new's per-rank expert multisets (relabelled), hence
        the same balance under any load.
    """
    _check_compatible(current, new)
    num_layers, num_ranks, per_rank = current.num_layers, current.num_ranks, current.slots_per_rank
    if num_ranks % num_nodes:
        raise ValueError(f"{num_ranks} ranks do not split into {num_nodes} nodes")
    old = current.phy2log.view(num_layers, num_ranks, per_rank)
    fresh = new.phy2log.view(num_layers, num_ranks, per_rank)
    overlap = _overlap(old, fresh, current.num_experts)  # [L, R(new), R(old)]
    node = torch.arange(num_ranks) // (num_ranks // num_nodes)
    overlap = overlap.masked_fill(node.view(-1, 1) != node.view(1, -1), -1)  # never cross nodes
    target = _match(overlap, opt_passes)  # [L, R(new)] -> old rank it takes over
    relabelled = torch.empty_like(fresh).scatter_(1, target.unsqueeze(-1).expand_as(fresh), fresh)
    return Placement(_keep_slots(old, relabelled).flatten(1), new.num_experts, new.num_ranks)


# The name services/balancer/policy.py imports.
align_to = align


def moves_per_layer(current: Placement, new: Placement) -> torch.Tensor:
    """[L] int64: slots whose logical expert differs, i.e. the expert copies the mover does."""
    _check_compatible(current, new)
    return (current.phy2log != new.phy2log).sum(1)


def _overlap(old: torch.Tensor, fresh: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[L, R(new), R(old)]: how many of each new rank's slots hold experts the old rank has."""
    num_layers, num_ranks, per_rank = old.shape
    present = torch.zeros(num_layers, num_ranks, num_experts, dtype=torch.int64)
    present.scatter_(2, old, 1)  # [L, R(old), E]
    hits = present.gather(2, fresh.flatten(1).unsqueeze(1).expand(-1, num_ranks, -1))  # [L, R(old), R*S]
    return hits.view(num_layers, num_ranks, num_ranks, per_rank).sum(-1).transpose(1, 2)


def _match(overlap: torch.Tensor, opt_passes: int) -> torch.Tensor:
    """[L, R] a permutation per layer, new rank -> old rank, of large total overlap."""
    num_layers, num_ranks, _ = overlap.shape
    layer = torch.arange(num_layers)
    score = overlap.double().clone()
    target = torch.empty(num_layers, num_ranks, dtype=torch.int64)
    for _ in range(num_ranks):
        pick = score.flatten(1).argmax(1)
        a, b = pick // num_ranks, pick % num_ranks
        target[layer, a] = b
        score[layer, a, :] = -torch.inf
        score[layer, :, b] = -torch.inf
    # 2-opt: new ranks a1, a2 trade their old ranks when that raises the overlap.
    for _ in range(opt_passes):
        mine = overlap.gather(2, target.unsqueeze(-1)).squeeze(-1)  # [L, R]
        theirs = overlap.gather(2, target.unsqueeze(1).expand(-1, num_ranks, -1))  # [L, a1, a2]: ov[a1, t[a2]]
        gain = theirs + theirs.transpose(1, 2) - mine.unsqueeze(2) - mine.unsqueeze(1)
        best = gain.flatten(1).max(1)
        go = best.values > 0
        if not bool(go.any()):
            break
        a1, a2 = best.indices[go] // num_ranks, best.indices[go] % num_ranks
        li = layer[go]
        t1 = target[li, a1].clone()
        target[li, a1] = target[li, a2]
        target[li, a2] = t1
    return target


def _keep_slots(old: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """[L, R, S]: fresh's experts per rank, each one present in old kept at old's slot."""
    per_rank = old.shape[2]
    out = torch.full_like(fresh, -1)
    used = torch.zeros_like(fresh, dtype=torch.bool)  # fresh slots already placed
    for j in range(per_rank):
        # Old slot j keeps its expert if an unplaced fresh slot of the rank holds it.
        match = (fresh == old[..., j:j + 1]) & ~used  # [L, R, S]
        found = match.any(-1)
        first = match.long().argmax(-1)  # [L, R]
        out[..., j] = torch.where(found, old[..., j], -1)
        used |= torch.nn.functional.one_hot(first, per_rank).bool() & found.unsqueeze(-1)
    # Arriving experts fill the free slots in their order within the fresh rank.
    free = out == -1
    rest_rank = torch.cumsum(free.long(), -1) - 1  # k-th free slot
    leftover_key = torch.where(used, per_rank, torch.arange(per_rank))  # unplaced first, in order
    leftover = fresh.gather(-1, leftover_key.argsort(dim=-1, stable=True))
    return torch.where(free, leftover.gather(-1, rest_rank.clamp_min(0)), out)


def _check_compatible(a: Placement, b: Placement) -> None:
    if (a.num_layers, a.num_experts, a.num_ranks, a.num_slots) != (b.num_layers, b.num_experts, b.num_ranks,
                                                                  b.num_slots):
        raise ValueError("placements differ in layers, experts, ranks or slots")
