"""The expert placement of one decode instance, and how balanced it is under a load.

Glossary:
- logical expert: one of the E experts of a MoE layer, as the router sees it (id 0..E-1).
- physical slot: one place in a rank's expert weight buffer that holds one logical
  expert's weights. Slot p lives on rank p // S, where S is slots per rank.
- replica: a physical slot holding a given logical expert. An expert has one or more;
  tokens routed to it are split evenly over its replicas.
- rank: one GPU of the instance's expert-parallel group. Every rank has S slots.
- instance: all R ranks of one decode deployment, P = R * S slots per layer.
- redundant slots: the K = S - E/R slots per rank beyond the one-copy minimum.

Balance ratio of a layer = mean(rank loads) / max(rank loads), 1.0 being perfect.
Instance ratio = sum over layers of mean / sum over layers of max, so heavy layers
weigh more, as they do in step time.

Shapes: L = layers, E = logical experts, R = ranks, S = slots per rank, P = R * S,
X = most replicas of any expert.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moemesh.shared.config.common import EXPERT_PLACEMENTS

FORMAT = "moemesh.eplb.placement/v1"


@dataclass(frozen=True)
class Placement:
    """Which logical expert every physical slot holds, for every layer.

    Args:
        phy2log: [L, P] int64, the logical expert held by each slot.
        num_experts: E; every id 0..E-1 must appear at least once per layer.
        num_ranks: R; P must be a multiple of it.
    """

    phy2log: torch.Tensor
    num_experts: int
    num_ranks: int

    def __post_init__(self) -> None:
        t = self.phy2log
        if t.dim() != 2 or t.dtype != torch.int64:
            raise ValueError(f"phy2log must be a 2-D int64 tensor, got {t.dtype} {tuple(t.shape)}")
        if self.num_ranks <= 0 or t.shape[1] % self.num_ranks:
            raise ValueError(f"{t.shape[1]} slots do not split over {self.num_ranks} ranks")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_experts):
            raise ValueError(f"phy2log holds an expert id outside 0..{self.num_experts - 1}")
        if bool((self.replica_counts() == 0).any()):
            raise ValueError("some logical expert has no replica in some layer")

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def num_redundant(self) -> int:
        """K, redundant slots per rank (0 when E does not divide evenly over ranks)."""
        return max(self.slots_per_rank - self.num_experts // self.num_ranks, 0)

    def replica_counts(self) -> torch.Tensor:
        """[L, E] int64: how many slots hold each logical expert."""
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=self.phy2log.device)
        return counts.scatter_add_(1, self.phy2log, torch.ones_like(self.phy2log))

    def log2phy(self) -> torch.Tensor:
        """[L, E, X] int64: the slots of each expert in ascending order, -1 padded.

        This is the routing table: a token routed to expert e in layer l goes to
        log2phy[l, e, i] for some i < replica_counts()[l, e], e.g. i = token % count.
        """
        counts = self.replica_counts()
        width = int(counts.max()) if counts.numel() else 0
        # A stable sort by expert lists each expert's slots contiguously, in slot order.
        order = torch.sort(self.phy2log, dim=1, stable=True).indices  # [L, P]
        first = torch.cumsum(counts, dim=1) - counts  # [L, E] start of each run in order
        experts = self.phy2log.gather(1, order)
        device = self.phy2log.device
        which = torch.arange(self.num_slots, device=device).expand_as(order) - first.gather(1, experts)
        table = torch.full((self.num_layers, self.num_experts, width), -1, dtype=torch.int64, device=device)
        flat = table.view(self.num_layers, -1)
        flat.scatter_(1, experts * width + which, order)
        return table

    def slot_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """[L, P] float64: each slot's share of its expert's load [L, E]."""
        _check_loads(loads, self)
        share = loads.double() / self.replica_counts().double()
        return share.gather(1, self.phy2log)

    def rank_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """[L, R] float64: the load each rank serves under per-expert loads [L, E]."""
        return self.slot_loads(loads).view(self.num_layers, self.num_ranks, -1).sum(-1)

    def layer_ratios(self, loads: torch.Tensor) -> torch.Tensor:
        """[L] float64: mean / max rank load per layer (1.0 for an idle layer)."""
        return layer_ratios(self.rank_loads(loads))

    def instance_ratio(self, loads: torch.Tensor) -> float:
        return instance_ratio(self.rank_loads(loads))

    def to_json(self, **extra) -> dict:
        """The file format of `moemesh eplb place`; see docs/eplb.md."""
        layers = self.phy2log.view(self.num_layers, self.num_ranks, -1).tolist()
        return {"format": FORMAT, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "num_ranks": self.num_ranks, "slots_per_rank": self.slots_per_rank,
                "num_redundant": self.num_redundant, "layers": layers, **extra}

    @classmethod
    def from_json(cls, obj: dict) -> Placement:
        if obj.get("format") != FORMAT:
            raise ValueError(f"not a placement file: format is {obj.get('format')!r}, want {FORMAT!r}")
        layers = torch.tensor(obj["layers"], dtype=torch.int64)  # [L, R, S]
        if layers.dim() != 3 or layers.shape[1] != obj["num_ranks"]:
            raise ValueError("placement 'layers' must be [layers][ranks][slots] with num_ranks ranks")
        return cls(layers.flatten(1).contiguous(), int(obj["num_experts"]), int(obj["num_ranks"]))


def route_to_slots(log2phy: torch.Tensor, counts: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Physical slots for one layer's routed tokens, spreading each expert over its replicas.

    Args:
        log2phy: [E, X] one layer of Placement.log2phy().
        counts: [E] that layer's replica_counts().
        topk_ids: [T, A] logical experts chosen per token (A = experts per token).
    Returns:
        [T, A] slot ids: token t uses replica t mod count, so a batch splits evenly.
    """
    token = torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)  # [T, 1]
    which = token % counts[topk_ids]  # [T, A]
    return log2phy[topk_ids, which]


def layer_ratios(rank_loads: torch.Tensor) -> torch.Tensor:
    """[..., R] rank loads -> [...] mean / max, 1.0 where a layer carried no load."""
    peak = rank_loads.amax(-1)
    return torch.where(peak > 0, rank_loads.mean(-1) / peak.clamp_min(1e-30), torch.ones_like(peak))


def instance_ratio(rank_loads: torch.Tensor) -> float:
    """[L, R] rank loads -> one ratio, weighting each layer by its load."""
    peak = float(rank_loads.amax(-1).sum())
    return float(rank_loads.mean(-1).sum()) / peak if peak > 0 else 1.0


def naive_placement(num_layers: int, num_experts: int, num_ranks: int, num_redundant: int = 0,
                    strategy: str = "linear") -> Placement:
    """The placement an instance starts with, before any balancing.

    linear: rank r holds experts r*E/R .. (r+1)*E/R - 1 in its first slots.
    round_robin: rank r holds experts r, r+R, r+2R, ... A grouped router (DeepSeek's
    topk_group) sends a token to a few groups of consecutive experts; linear keeps a
    group on one rank (or one node), so a token's pairs land on few ranks, which limits
    cross-node traffic but makes each step's draw uneven across ranks. round_robin spreads
    every group over all ranks: the draw evens out, at the price of each token reaching
    more ranks. It suits an instance within one node.

    Either way, a rank's K redundant slots repeat its own first K experts, so the
    redundancy changes no rank's load.
    """
    if strategy not in EXPERT_PLACEMENTS:
        raise ValueError(f"expert placement must be one of {', '.join(EXPERT_PLACEMENTS)}, got {strategy!r}")
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not split evenly over {num_ranks} ranks")
    per_rank = num_experts // num_ranks
    if num_redundant > per_rank:
        raise ValueError(f"naive placement repeats a rank's own experts: K={num_redundant} > E/R={per_rank}")
    if strategy == "linear":
        own = torch.arange(num_experts).view(num_ranks, per_rank)  # [R, E/R]
    else:
        own = torch.arange(num_experts).view(per_rank, num_ranks).T  # [R, E/R]
    ranks = torch.cat([own, own[:, :num_redundant]], dim=1).flatten()  # [P]
    return Placement(ranks.expand(num_layers, -1).contiguous(), num_experts, num_ranks)


def slots_per_rank(num_experts: int, num_ranks: int, num_redundant: int) -> int:
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not split evenly over {num_ranks} ranks")
    if num_redundant < 0:
        raise ValueError("redundant slots per rank must be >= 0")
    return num_experts // num_ranks + num_redundant


def load_loads(path: str | Path) -> torch.Tensor:
    """Reads a loads file (docs/eplb.md): {"loads": [[count per expert] per layer]}."""
    obj = json.loads(Path(path).read_text())
    rows = obj["loads"] if isinstance(obj, dict) else obj
    loads = torch.tensor(rows, dtype=torch.float64)
    if loads.dim() != 2 or loads.shape[1] == 0:
        raise ValueError(f"{path}: 'loads' must be a non-empty [layers][experts] array")
    if bool((loads < 0).any()) or not bool(torch.isfinite(loads).all()):
        raise ValueError(f"{path}: loads must be finite and non-negative")
    return loads


def _check_loads(loads: torch.Tensor, placement: Placement) -> None:
    want = (placement.num_layers, placement.num_experts)
    if tuple(loads.shape) != want:
        raise ValueError(f"loads are {tuple(loads.shape)}, placement needs [layers, experts] = {want}")
