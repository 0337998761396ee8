"""What the balancer knows about one DEP instance: per-rank expert loads over their
recent windows, and the placement in force."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moemesh.shared.eplb.placement import Placement
from moemesh.shared.protocol.messages import ExpertLoad
from moemesh.shared.service.dep_runtime import tensor_from


@dataclass
class InstanceView:
    instance_id: str
    dp_size: int
    layer_ids: list[int]
    num_target_layers: int
    num_experts: int
    slots_per_rank: int
    loads_by_rank: dict[int, torch.Tensor] = field(default_factory=dict)  # rank -> [L, E]
    seen_at: dict[int, float] = field(default_factory=dict)
    version: int = -1
    phy2log: torch.Tensor | None = None  # [L, P]
    last_move_at: float = 0.0
    moving: bool = False

    @classmethod
    def from_load(cls, m: ExpertLoad) -> "InstanceView":
        return cls(m.instance_id, m.dp_size, list(m.layer_ids), m.num_target_layers, m.num_experts,
                   m.slots_per_rank)

    def observe(self, m: ExpertLoad) -> None:
        """Takes a rank's report; raises ValueError for one whose counts or placement cannot
        be right (the view keeps what it had)."""
        counts = tensor_from(m.counts, len(m.layer_ids))
        if bool((counts < 0).any()):
            raise ValueError(f"rank {m.rank} reported negative expert counts")
        if m.rank == 0 and m.phy2log:
            Placement(tensor_from(m.phy2log, len(m.layer_ids)), m.num_experts, m.dp_size)  # every expert placed
        self.loads_by_rank[m.rank] = counts
        self.seen_at[m.rank] = time.monotonic()
        # During a move the move's outcome sets the placement: a report from before the
        # switch would roll it back, one from after it would count the switch twice.
        if m.rank == 0 and m.phy2log and not self.moving:
            self.phy2log = tensor_from(m.phy2log, len(m.layer_ids))
            self.version = m.placement_version

    @property
    def complete(self) -> bool:
        return self.phy2log is not None and len(self.loads_by_rank) == self.dp_size

    def loads(self) -> torch.Tensor:
        """[L, E] the instance's tokens per layer and expert (every rank's tokens)."""
        return torch.stack(list(self.loads_by_rank.values())).sum(0)

    def placement(self) -> Placement:
        return Placement(self.phy2log, self.num_experts, self.dp_size)

    def rows(self, draft: bool) -> list[int]:
        return [i for i, lid in enumerate(self.layer_ids) if (lid >= self.num_target_layers) == draft]
