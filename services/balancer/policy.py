"""The balancer's use of the placement policy (shared/eplb): propose a placement for an
instance from its window of loads, and decide whether moving to it is worth it."""

from __future__ import annotations

import time

import torch

from services.balancer.config import BalancerConfig
from services.balancer.state import InstanceView
from shared.eplb.placement import Placement
from shared.eplb.policy import get_policy


def propose(view: InstanceView, loads: torch.Tensor, cfg: BalancerConfig) -> tuple[Placement, float]:
    """(candidate placement aligned to the current one, seconds of compute)."""
    t0 = time.perf_counter()
    redundant = view.slots_per_rank - view.num_experts // view.dp_size
    policy = get_policy(cfg.algorithm, num_nodes=cfg.num_nodes, num_groups=max(cfg.num_nodes, 1))
    cand = policy.place(loads.double(), view.dp_size, redundant)
    cand = _align(view.placement(), cand)
    return cand, time.perf_counter() - t0


def _align(current: Placement, cand: Placement) -> Placement:
    """Within each rank, keep experts that stay there in the slots they already occupy, so
    only real moves copy weights. Rank contents, and so the balance, are unchanged."""
    try:
        from shared.eplb.align import align_to
    except ImportError:
        return cand
    return align_to(current, cand)


class Decider:
    """Moves only when it pays: the current ratio has fallen below trigger_ratio, the
    candidate beats it by min_gain, and the last move is cooldown_s old. The margin keeps
    noise in the window from flipping placements back and forth."""

    def __init__(self, cfg: BalancerConfig):
        self.cfg = cfg
        self.last_move = float("-inf")

    def should_move(self, current: Placement, cand: Placement, loads: torch.Tensor, now: float) -> bool:
        if now - self.last_move < self.cfg.cooldown_s:
            return False
        cur = current.instance_ratio(loads)
        if cur >= self.cfg.trigger_ratio:
            return False
        return cand.instance_ratio(loads) - cur >= self.cfg.min_gain

    def moved(self, now: float) -> None:
        self.last_move = now
