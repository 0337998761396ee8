"""Our expert-placement policy (policies.py names it, beside DeepSeek's, behind the seam).

A policy turns per-layer expert loads into a Placement. Ours works in two steps, each
vectorised across layers (no per-layer Python loop, so 43 layers cost about what one
does):

1. replica counts (replicas.py): D'Hondt, unless the bound says its slots cannot be
   packed evenly, then the nearest candidate that can;
2. slot arrangement (packing.py): deal slots to ranks in rounds, separate duplicate
   replicas, then pair-exchange swaps between heavy and light ranks; where that stops
   short, again from a greedy start (DeepSeek's packing), keeping the better;
3. next-window choice (expected.py), from scratch only: each layer keeps DeepSeek's
   exact placement unless steps 1-2 clearly serve the next window better.

It is global: any slot may go to any rank, as for decode, where all ranks of the
instance exchange tokens all-to-all. It takes loads as given; smoothing windows into
loads is the caller's choice (the balancer's load statistics).

Shapes: L = layers, E = experts, R = ranks, S = slots per rank, P = R * S.
"""

from __future__ import annotations

import torch

from moemesh.shared.eplb.expected import NextWindow, better_layers
from moemesh.shared.eplb.packing import pack, pack_greedy
from moemesh.shared.eplb.placement import Placement, slots_per_rank
from moemesh.shared.eplb.reference import replicate
from moemesh.shared.eplb.replicas import choose_counts, max_load_bound


def build_placement(loads: torch.Tensor, num_ranks: int, num_redundant: int, *, num_rounds: int = 24,
                    current: Placement | None = None, target: float | None = None,
                    next_window: NextWindow | None = NextWindow()) -> Placement:
    """Our policy: see the module docstring. Arguments as policies.PlacementPolicy.place, plus:

    Args:
        num_rounds: most pair-exchange rounds.
        current: the running placement, to start from (incremental mode): experts keep
            their slots unless their replica count changed or a swap evens the ranks,
            so a new placement costs tens of expert copies per layer, not hundreds.
        target: in-window mean/max at which swapping stops; default 0.999 from
            scratch and 0.995 incremental: past that, swaps mostly fit the window's
            noise (held out they gain under 0.001), and incrementally each costs two
            expert copies.
        next_window: from scratch, each layer keeps DeepSeek's placement unless ours
            is expected to serve the next window better (expected.py); None keeps
            ours everywhere.
    """
    if loads.dim() != 2:
        raise ValueError(f"loads must be [layers, experts], got {tuple(loads.shape)}")
    if bool((loads < 0).any()) or not bool(torch.isfinite(loads).all()):
        raise ValueError("loads must be finite and non-negative")
    num_layers, num_experts = loads.shape
    per_rank = slots_per_rank(num_experts, num_ranks, num_redundant)
    w = loads.double()
    counts, bound = choose_counts(w, num_ranks, per_rank)  # [L, E], [L]
    if current is None:
        experts = torch.repeat_interleave(torch.arange(num_experts).repeat(num_layers), counts.flatten())
        experts = experts.view(num_layers, -1)  # [L, P] each expert's slots together
    else:
        if current.phy2log.shape != (num_layers, num_ranks * per_rank) or current.num_ranks != num_ranks \
                or current.num_experts != num_experts:
            raise ValueError("current placement does not match the loads, ranks and redundant slots")
        # Keep the running counts where they pack as well as the new ones and their
        # largest slot is at most 10% bigger: count changes from window noise cost
        # copies and buy nothing, while drift that makes an expert hot must still get
        # it more replicas (without the 10% rule, held-out fell 0.005 behind rebuilding
        # every window over 24 windows at 10% drift; with it, 0.001-0.002).
        held = current.replica_counts()
        held_bound = max_load_bound(w, held, num_ranks, per_rank)
        keep = (held_bound <= bound * (1 + 1e-3)) & (held.amax(1) <= num_ranks)
        keep &= (w / held).amax(1) <= (w / counts).amax(1) * 1.1
        counts, bound = torch.where(keep.unsqueeze(1), held, counts), torch.where(keep, held_bound, bound)
        experts = _reconcile(current.phy2log, counts)
    share = (w / counts).gather(1, experts)  # [L, P]
    if target is None:
        target = 0.999 if current is None else 0.995
    floor = bound * w.sum(1) / num_ranks  # [L] no packing of these counts beats it
    order = pack(share, experts, num_ranks, num_rounds=num_rounds, target=target, floor=floor,
                 warm=current is not None)
    phy2log = experts.gather(1, order)
    if current is None and next_window is not None and 1 < num_ranks < phy2log.shape[1]:
        phy2log = _for_next_window(w, phy2log, num_ranks, per_rank, next_window)
    return Placement(phy2log, num_experts, num_ranks)


def _for_next_window(w: torch.Tensor, ours: torch.Tensor, num_ranks: int, per_rank: int,
                     model: NextWindow) -> torch.Tensor:
    """[L, P]: DeepSeek's placement, except in the layers where ours [L, P] is expected
    to serve the next window better by a margin that its spread does not swallow.

    In-window, ours is never behind; held out, swaps that even out the observed window
    gain nothing where they only fit its sampling noise, and a layer that serves
    exactly as DeepSeek's does cannot fall behind it.
    """
    theirs = deepseek_like(w, num_ranks, per_rank)
    take = better_layers(w, theirs, ours, num_ranks, model)  # [L]
    return torch.where(take.unsqueeze(1), ours, theirs)


def _reconcile(phy2log: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[L, P]: phy2log with replicas dropped or added so each expert has counts [L, E] slots.

    An expert that loses replicas keeps its first ones in slot order; the freed slots
    take the experts that gain, in expert order. Packing then evens the ranks out.
    """
    num_layers, num_slots = phy2log.shape
    had = torch.zeros_like(counts).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    by_expert = torch.sort(phy2log, dim=1, stable=True)  # each expert's slots together, in slot order
    first = torch.cumsum(had, 1) - had  # [L, E] start of each expert's run
    nth = torch.empty_like(phy2log).scatter_(
        1, by_expert.indices, torch.arange(num_slots).expand(num_layers, -1) - first.gather(1, by_expert.values))
    free = nth >= counts.gather(1, phy2log)  # [L, P] replicas beyond the new count
    gained = (counts - had).clamp_min(0)  # [L, E]
    # Both lists run layer by layer with equal lengths per layer, so they line up.
    arriving = torch.repeat_interleave(torch.arange(counts.shape[1]).repeat(num_layers), gained.flatten())
    out = phy2log.clone()
    out[free] = arriving
    return out


def deepseek_like(loads: torch.Tensor, num_ranks: int, per_rank: int) -> torch.Tensor:
    """[L, P] phy2log of DeepSeek's global EPLB (reference.py), its packing vectorised
    across layers: the same slots on the same ranks, duplicates included."""
    experts, counts = replicate(loads.float(), num_ranks * per_rank)  # loop over slots, not layers
    # Float32 shares and the same sort call as the rewrite: equal slots break ties alike.
    share = (loads.float() / counts).gather(1, experts)
    return experts.gather(1, pack_greedy(share, num_ranks))
