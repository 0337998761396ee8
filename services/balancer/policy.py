"""The balancer's use of the placement policy (shared/eplb): propose a placement for an
instance from one window of loads, and decide on the NEXT window (held out) whether
moving to it is worth it."""

from __future__ import annotations

import time

import torch

from moemesh.services.balancer.config import BalancerConfig
from moemesh.services.balancer.state import InstanceView
from moemesh.shared.eplb import align
from moemesh.shared.eplb.hysteresis import SwitchConfig, SwitchState, decide
from moemesh.shared.eplb.placement import Placement
from moemesh.shared.eplb.policies import get_policy


def propose(view: InstanceView, loads: torch.Tensor, cfg: BalancerConfig) -> tuple[Placement, float]:
    """(candidate placement aligned to the running one, seconds of compute)."""
    t0 = time.perf_counter()
    redundant = view.slots_per_rank - view.num_experts // view.dp_size
    policy = get_policy(cfg.algorithm, num_nodes=cfg.num_nodes, num_groups=max(cfg.num_nodes, 1))
    current = view.placement()
    cand = policy.place(loads.double(), view.dp_size, redundant, current=current if cfg.incremental else None)
    # Within each rank, experts that stay keep their slots, so only real moves copy weights.
    cand = align(current, cand)
    return cand, time.perf_counter() - t0


class Decider:
    """Holds a candidate built on one window until the next window's loads judge it."""

    def __init__(self, cfg: BalancerConfig):
        self.config = SwitchConfig(cfg.trigger_ratio, cfg.min_gain, cfg.cooldown_gain, cfg.cooldown_windows)
        self.state = SwitchState()
        self.pending: Placement | None = None

    def judge(self, current: Placement, held_out_loads: torch.Tensor) -> Placement | None:
        """The pending candidate if it should replace `current` on these (held-out) loads."""
        cand, self.pending = self.pending, None
        if cand is None or cand.phy2log.shape != current.phy2log.shape:
            return None
        d = decide(current, cand, held_out_loads, self.state, self.config)
        self.state = d.state
        return cand if d.switch else None
