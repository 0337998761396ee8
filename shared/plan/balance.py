"""The balancer in the loop: where experts sit at a given width, and what each rank serves.

For a width N and K redundant slots per rank, the placement is either the naive one (the
instance before any balancing) or the project's own policy (shared/eplb, `build_placement`)
built on the skew's build window. Each step of the step model then draws that step's
routed pairs from the served window and sends them through the placement, so the
slowest rank's load includes the step's sampling noise, which a small batch has much of.

Shapes: S = sampled steps, L = MoE layers, E = experts, N = ranks, P = N * slots per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moemesh.shared.eplb.placement import Placement, naive_placement
from moemesh.shared.eplb.policy import build_placement
from moemesh.shared.plan.skew import Skew


@dataclass(frozen=True)
class Balance:
    """One width's placement and how it serves the skew.

    Args:
        width: N.
        placement: the placement in force.
        ratio: held-out instance balance ratio (mean / max rank load) of `placement`.
        ratio_naive: the same for the naive placement, i.e. before EPLB.
    """

    width: int
    placement: Placement
    ratio: float
    ratio_naive: float

    def sample(self, popularity: torch.Tensor, pairs_per_layer, num_steps: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Draws num_steps steps of routed pairs and sends them through the placement.

        Args:
            popularity: [L, E] routing probabilities.
            pairs_per_layer: routed pairs per MoE layer over the whole instance, one
                figure or one per step ([S]).
        Returns:
            ([S, L, N] pairs each rank computes, [S, L, N] slots each rank reads weights
            for: a replica is read when its expert got at least as many pairs as its
            place among the expert's replicas).
        """
        p = popularity.numpy()
        n = np.rint(np.broadcast_to(np.asarray(pairs_per_layer, dtype=np.float64), (num_steps,))).astype(np.int64)
        counts = rng.multinomial(n[:, None], p, size=(num_steps, p.shape[0])).astype(np.float64)  # [S, L, E]
        phy = self.placement.phy2log.numpy()  # [L, P]
        reps = self.placement.replica_counts().numpy().astype(np.float64)  # [L, E]
        nth = _replica_index(phy)  # [L, P]
        layer = np.arange(phy.shape[0])[:, None]
        slot_pairs = counts[:, layer, phy] / reps[layer, phy]  # [S, L, P] even split over replicas
        active = (counts[:, layer, phy] > nth).astype(np.float64)
        shape = (num_steps, phy.shape[0], self.width, -1)
        return slot_pairs.reshape(shape).sum(-1), active.reshape(shape).sum(-1)


def _replica_index(phy2log: np.ndarray) -> np.ndarray:
    """[L, P]: each slot's place (0, 1, ...) among the slots of its expert, in slot order."""
    order = np.argsort(phy2log, axis=1, kind="stable")
    sorted_e = np.take_along_axis(phy2log, order, 1)
    pos = np.arange(phy2log.shape[1])[None, :].repeat(phy2log.shape[0], 0)
    new_run = np.ones_like(sorted_e, dtype=bool)
    new_run[:, 1:] = sorted_e[:, 1:] != sorted_e[:, :-1]
    start = np.maximum.accumulate(np.where(new_run, pos, 0), axis=1)
    out = np.empty_like(phy2log)
    np.put_along_axis(out, order, pos - start, 1)
    return out


def balance(skew: Skew, width: int, num_redundant: int, *, eplb: bool = True) -> Balance:
    """The placement at `width` ranks: ours (eplb=True) or naive, and both held-out ratios.

    Width 1 needs no placement: one rank holds every expert and its ratio is 1.
    """
    num_layers, num_experts = skew.score.shape
    k = num_redundant if width > 1 else 0
    naive = naive_placement(num_layers, num_experts, width, min(k, num_experts // width))
    ratio_naive = naive.instance_ratio(skew.score.double())
    if width == 1 or not eplb:
        return Balance(width, naive, ratio_naive, ratio_naive)
    ours = build_placement(skew.build.double(), width, k)
    return Balance(width, ours, ours.instance_ratio(skew.score.double()), ratio_naive)
