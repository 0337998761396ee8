"""The seam every expert-placement algorithm plugs into, and the algorithms by name:
ours (policy.py), ours node-aware (hierarchy.py) and DeepSeek's EPLB (reference.py).

Shapes: L = layers, E = experts, R = ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from moemesh.shared.eplb.hierarchy import build_hierarchical
from moemesh.shared.eplb.placement import Placement
from moemesh.shared.eplb.policy import build_placement
from moemesh.shared.eplb.reference import rebalance


class PlacementPolicy(Protocol):
    name: str

    def place(self, loads: torch.Tensor, num_ranks: int, num_redundant: int,
              current: Placement | None = None) -> Placement:
        """Builds a placement.

        Args:
            loads: [L, E] tokens routed to each logical expert over the load window.
            num_ranks: R ranks of the instance.
            num_redundant: K redundant slots per rank (S = E / R + K).
            current: the running placement; a policy may start from it to move less
                (ours does; DeepSeek's ignores it, align() then saves what it can).
        Returns:
            A placement with R * S slots per layer and every expert at least once.
        """
        ...


@dataclass(frozen=True)
class OursPolicy:
    name: str = "ours"

    def place(self, loads: torch.Tensor, num_ranks: int, num_redundant: int,
              current: Placement | None = None) -> Placement:
        return build_placement(loads, num_ranks, num_redundant, current=current)


@dataclass(frozen=True)
class OursHierarchicalPolicy:
    """Ours, node-aware (hierarchy.py): expert groups whole on nodes, ours within each node.
    Builds from scratch: `current` is ignored (align() within nodes saves the moves)."""

    num_nodes: int = 4
    num_groups: int = 8
    name: str = "ours-hierarchical"

    def place(self, loads: torch.Tensor, num_ranks: int, num_redundant: int,
              current: Placement | None = None) -> Placement:
        return build_hierarchical(loads, num_ranks, num_redundant, num_nodes=self.num_nodes,
                                  num_groups=self.num_groups)


@dataclass(frozen=True)
class DeepSeekPolicy:
    """DeepSeek EPLB (reference.py): global when num_nodes == 1, else hierarchical."""

    num_nodes: int = 1
    num_groups: int = 1

    @property
    def name(self) -> str:
        return "deepseek-global" if self.num_nodes == 1 else "deepseek-hierarchical"

    def place(self, loads: torch.Tensor, num_ranks: int, num_redundant: int,
              current: Placement | None = None) -> Placement:
        return rebalance(loads, num_ranks, num_redundant, num_nodes=self.num_nodes,
                                   num_groups=self.num_groups)


def get_policy(algorithm: str, *, num_nodes: int = 4, num_groups: int = 8) -> PlacementPolicy:
    """Policy by CLI name: "ours", "ours-hierarchical", "deepseek-global" or "deepseek-hierarchical"."""
    if algorithm == "ours":
        return OursPolicy()
    if algorithm == "ours-hierarchical":
        return OursHierarchicalPolicy(num_nodes=num_nodes, num_groups=num_groups)
    if algorithm == "deepseek-global":
        return DeepSeekPolicy()
    if algorithm == "deepseek-hierarchical":
        return DeepSeekPolicy(num_nodes=num_nodes, num_groups=num_groups)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def timed_place(policy: PlacementPolicy, loads: torch.Tensor, num_ranks: int, num_redundant: int,
                current: Placement | None = None) -> tuple[Placement, float]:
    """(placement, milliseconds of compute), timed on the calling thread's torch settings."""
    start = time.perf_counter()
    placement = policy.place(loads, num_ranks, num_redundant, current)
    return placement, (time.perf_counter() - start) * 1e3
