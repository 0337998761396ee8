"""Expert parallelism: routed experts spread over the ranks of an instance.

Glossary:
- instance: one DEP-N deployment of the model, N rank processes stepping in lockstep.
- rank: one process of an instance. Attention is data-parallel: each rank owns its own
  requests and KV cache. MoE layers are expert-parallel: each rank holds a share of the
  experts, and tokens travel to them and back with all-to-all.
- logical expert: expert e of the checkpoint, 0 <= e < E.
- physical slot: a place for one expert's weights. Each rank holds S = E/N + R slots
  (R redundant), so an instance has P = N*S; global slot p lives on rank p // S at
  local index p % S.
- replica: a slot holding a given logical expert. A hot expert may get several; the
  tokens routed to it are split evenly over its replicas.
- placement: per MoE layer, which logical expert each physical slot holds
  (`phy2log`, [P]); the engine derives `log2phy` ([E, max replicas]) to route tokens.

T = tokens on this rank, K = experts per token, D = hidden, N = ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from moemesh.shared.eplb.placement import Placement, naive_placement
from moemesh.shared.kernels.fused_moe import fused_moe


def start_phy2log(num_experts: int, num_ranks: int, redundant: int, strategy: str = "linear") -> torch.Tensor:
    """The start-up placement of one layer ([P]); see moemesh.shared.eplb.placement.naive_placement."""
    return naive_placement(1, num_experts, num_ranks, redundant, strategy).phy2log[0]


def log2phy_of(phy2log: torch.Tensor, num_experts: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """phy2log [P] -> (log2phy [E, max replicas] padded with -1, replica counts [E]).
    Raises ValueError when an expert has no replica."""
    p = Placement(phy2log[None], num_experts, num_ranks)
    return p.log2phy()[0], p.replica_counts()[0]


def to_replicas(flat: torch.Tensor, log2phy: torch.Tensor, counts: torch.Tensor,
                turn: torch.Tensor, one_each: bool = False) -> torch.Tensor:
    """Global slots for routed pairs, each expert's pairs dealt round-robin over its replicas.

    The n-th pair routed to expert e goes to replica (turn[e] + n) mod replicas(e), and
    turn[e] then advances by e's pairs, so the deal carries on across calls. Dealing by
    the pair's place among e's own pairs, not its place in the batch, matters for
    hash-routed layers: there a token id fixes the experts and their order, so a hot
    expert sits in the same top-k column for all its tokens, and a position-based pick
    (pair index mod replicas) would send them all to one replica.

    Args:
        flat: [T*K] logical experts of the routed pairs.
        log2phy: [E, X] slots of each expert, -1 padded.
        counts: [E] replicas of each expert.
        turn: [E] int64, updated in place: the replica each expert's next pair takes.
        one_each: every expert has one replica (counts all 1, known where the placement
            was set): the deal is the lookup alone, a few tensor ops fewer per layer.
    Returns:
        [T*K] global slots.
    """
    if one_each:
        turn.zero_()  # what dealing over one replica leaves
        return log2phy[flat, 0]
    n = flat.numel()
    by_expert = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=counts.numel())  # [E]
    first = torch.cumsum(per_expert, 0) - per_expert
    nth = torch.empty_like(flat)
    nth[by_expert] = torch.arange(n, device=flat.device) - first[flat[by_expert]]  # place among its expert's pairs
    phy = log2phy[flat, (turn[flat] + nth) % counts[flat]]
    turn.add_(per_expert).remainder_(counts)
    return phy


class EPLayer:
    """Routes one MoE layer's tokens to expert slots across the instance and back."""

    def __init__(self, experts, phy2log: torch.Tensor, num_experts: int, rank: int, world: int, group=None):
        self.experts = experts  # the layer's Experts module: this rank's S slots
        self.rank, self.world, self.group = rank, world, group
        self.num_experts = num_experts
        self.comm_s = 0.0  # time inside collectives, mostly waiting for the slowest rank
        self.slots_per_rank = experts.gate_up_proj.shape[0]
        # What a step reads lives where the experts do: the routed ids, the receive buffers
        # and the collectives (NCCL on a GPU) are there. The placement itself (phy2log) stays
        # on the host, where the balancer and the moves read it.
        self.device = dev = experts.gate_up_proj.device
        self.slot_tokens = torch.zeros(self.slots_per_rank, dtype=torch.long, device=dev)  # pairs each local slot ran
        # Ranks start their deals on different replicas, so single-token steps spread too.
        self.turn = torch.full((num_experts,), rank, dtype=torch.long, device=dev)
        self.set_placement(phy2log)

    def set_placement(self, phy2log: torch.Tensor) -> None:
        if phy2log.numel() != self.slots_per_rank * self.world:
            raise ValueError(f"placement has {phy2log.numel()} slots, instance has {self.slots_per_rank * self.world}")
        self.phy2log = phy2log.clone()
        log2phy, counts = log2phy_of(self.phy2log, self.num_experts, self.world)
        self.one_each = bool((counts == 1).all())
        self.log2phy, self.counts = log2phy.to(self.device), counts.to(self.device)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, K = ids.shape
        S, N = self.slots_per_rank, self.world
        flat = ids.reshape(-1)  # [T*K] logical experts
        phy = to_replicas(flat, self.log2phy, self.counts, self.turn, self.one_each)  # [T*K] global slots
        order = torch.argsort(phy, stable=True)  # by slot, hence by rank, as the local path sums
        dst = phy[order]
        send_counts = torch.bincount(dst // S, minlength=N)
        recv_counts = torch.empty_like(send_counts)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        n_in = sum(recv)
        x_in = x.new_empty(n_in, x.shape[1])
        dist.all_to_all_single(x_in, x[order // K].contiguous(), recv, send, group=self.group)
        slot_in = torch.empty(n_in, dtype=torch.long, device=x.device)
        dist.all_to_all_single(slot_in, (dst % S).contiguous(), recv, send, group=self.group)
        t1 = time.perf_counter()
        self.slot_tokens += torch.bincount(slot_in, minlength=S)
        ones = torch.ones(n_in, 1, dtype=weights.dtype, device=x.device)
        y = fused_moe(x_in, self.experts.gate_up_proj, self.experts.down_proj, slot_in[:, None], ones,
                      self.experts.swiglu_limit)
        y_back = x.new_empty(T * K, x.shape[1])
        t2 = time.perf_counter()
        dist.all_to_all_single(y_back, y, send, recv, group=self.group)
        self.comm_s += (t1 - t0) + (time.perf_counter() - t2)
        # Weighted and summed in fp32, rounded once, as the local path does (kernels/fused_moe.py).
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        w = weights.reshape(-1)[order].float()
        out.index_add_(0, order // K, y_back.float() * w[:, None])
        return out.to(x.dtype)


class ExpertParallel:
    """This rank's view of an instance's expert placement, one EPLayer per MoE layer."""

    def __init__(self, model, rank: int, world: int, phy2log: torch.Tensor, group=None):
        """phy2log: [num MoE layers (target, then MTP), P], in model.moe_layers() order:
        the layers of the model as loaded, so the MTP layer only where its weights were."""
        self.rank, self.world = rank, world
        self.layer_ids = sorted(model.moe_layers())
        E = model.cfg.n_routed_experts
        if phy2log.shape[0] != len(self.layer_ids):
            raise ValueError(f"placement has {phy2log.shape[0]} layers, model has {len(self.layer_ids)} MoE layers")
        self.layers: dict[int, EPLayer] = {}
        for row, lid in zip(phy2log, self.layer_ids):
            moe = model.moe_layers()[lid]
            self.layers[lid] = EPLayer(moe.experts, row, E, rank, world, group)
            moe.runner = self.layers[lid]

    @classmethod
    def naive(cls, model, rank: int, world: int, redundant: int, group=None,
              strategy: str = "linear") -> "ExpertParallel":
        """The start-up placement, one naive row per MoE layer the model has. Sized from the
        model, not its config: a config may declare an MTP layer whose weights the
        checkpoint lacks, and the loader then builds the model without it."""
        row = start_phy2log(model.cfg.n_routed_experts, world, redundant, strategy)
        return cls(model, rank, world, row.repeat(len(model.moe_layers()), 1), group)

    def take_comm_s(self) -> float:
        """Seconds spent in all-to-all since the last call (read between steps)."""
        total = sum(l.comm_s for l in self.layers.values())
        for l in self.layers.values():
            l.comm_s = 0.0
        return total

    def phy2log(self) -> torch.Tensor:
        return torch.stack([self.layers[l].phy2log for l in self.layer_ids])

    @staticmethod
    def naive_slot_map(num_experts: int, rank: int, world: int, redundant: int, strategy: str = "linear"):
        """For the checkpoint loader, before the model exists: under the naive placement
        every MoE layer holds the same experts, so the map needs no list of layers.
        Returns (MoE layer id -> logical expert of each local slot, slots per rank)."""
        row = start_phy2log(num_experts, world, redundant, strategy)
        S = row.numel() // world
        mine = row[rank * S : (rank + 1) * S].tolist()
        return (lambda layer: mine), S

    @staticmethod
    def local_slot_map(phy2log: torch.Tensor, layer_ids: list[int], rank: int, world: int):
        """For the checkpoint loader: MoE layer id -> logical expert of each local slot."""
        S = phy2log.shape[1] // world
        rows = {lid: phy2log[i, rank * S : (rank + 1) * S].tolist() for i, lid in enumerate(layer_ids)}
        return lambda layer: rows[layer]
