"""Routing skew as the planner takes it: expert popularity per MoE layer, in two windows.

A placement is built on one window and scored on the next (held out), as the balancer
does live: a placement never sees the traffic it serves. Spellings:
  uniform            every expert equally popular
  zipf:A             popularity ~ 1/rank^A over a seeded random order of experts, per layer
  hot:N:SHARE        N hot experts carry SHARE of the routed tokens (Zipf 0.2 among
                     themselves), the rest Zipf 0.25: the MTP draft head's shape
  (loads)            a recorded window, from_loads(): `bench eplb` / `mm.eplb.*.load`
Synthetic windows come from shared/eplb/workloads.py, the same generator that calibrated
the policy (docs/eplb.md): zipf:0.69 gives a naive ratio near 0.35 and hot:4:0.42 near
0.21 at 256 experts over 32 ranks.

Note the worker's `skew=` setting (shared/model/skew.py) is a router bias, not a
popularity: `zipf:1.2` there is not `zipf:1.2` here. To plan a run made with a bias,
take its recorded loads.

Shapes: L = MoE layers, E = experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.shared.eplb.workloads import Workload


@dataclass(frozen=True)
class Skew:
    """Two windows of routed-token counts: `build` for the placement, `score` to judge it.

    Args:
        spec: how it was made, for tables.
        build: [L, E] counts the placement is built from.
        score: [L, E] counts the placement serves (held out; == build for one recorded window).
    """

    spec: str
    build: torch.Tensor
    score: torch.Tensor

    @property
    def popularity(self) -> torch.Tensor:
        """[L, E] float64 routing probabilities of the served window."""
        s = self.score.double() + 1e-9
        return s / s.sum(1, keepdim=True)


def parse(spec: str, num_layers: int, num_experts: int, top_k: int, *, seed: int = 0,
          tokens_per_window: int = 65536, drift: float = 0.05) -> Skew:
    """A synthetic skew (see the module docstring); raises ValueError on a bad spelling."""
    kind, _, arg = (spec or "uniform").partition(":")
    if kind == "uniform":
        w = torch.full((num_layers, num_experts), tokens_per_window * top_k / num_experts, dtype=torch.float64)
        return Skew("uniform", w, w)
    try:
        if kind == "zipf":
            wl = Workload(kind="zipf", num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                          zipf_exponent=float(arg), tokens_per_window=tokens_per_window, drift=drift, seed=seed)
        elif kind == "hot":
            n, _, share = arg.partition(":")
            wl = Workload(kind="hot", num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                          num_hot=int(n), hot_share=float(share), zipf_exponent=0.25,
                          tokens_per_window=tokens_per_window, drift=drift, seed=seed)
        else:
            raise ValueError(f"unknown skew {spec!r}; use uniform, zipf:A or hot:N:SHARE")
    except ValueError as e:
        if "skew" in str(e):
            raise
        raise ValueError(f"skew {spec!r}: {e}") from None
    w = wl.windows(2).double()
    return Skew(spec, w[0], w[1])


def from_loads(loads: torch.Tensor, num_layers: int, spec: str = "recorded") -> Skew:
    """A recorded window [L', E] as the skew of `num_layers` layers: the recorded layers
    are repeated in order when the model has more (a small model's window planning a big
    one). Built and scored on the same window: one window has nothing held out."""
    if loads.dim() != 2 or loads.shape[0] < 1:
        raise ValueError("recorded loads must be [layers, experts]")
    reps = -(-num_layers // loads.shape[0])
    w = loads.double().repeat(reps, 1)[:num_layers]
    return Skew(spec, w, w)
