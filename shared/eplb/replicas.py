"""How many replicas each logical expert gets: the first half of our placement policy.

D'Hondt apportionment (what DeepSeek's EPLB does) gives each extra slot to the expert
whose per-replica load is then largest. That minimises the largest slot, but it can
leave the slots unpackable: four hot experts with 9 replicas each make 36 big slots for
32 ranks, so four ranks must hold two, and no choice of small slots can even them out
because every rank holds exactly S slots. We therefore score a family of candidates:

    candidate x = the first x D'Hondt extras, then one extra each for the largest
    experts those x did not touch (halving mid-sized experts into smaller fillers)

with a lower bound on the best achievable max rank load, and keep, per layer, the
candidate closest to D'Hondt (largest x) whose bound is within `tolerance` of the best.
x = X (all extras by D'Hondt) is always a candidate, so nothing is lost where D'Hondt
packs well; layers where D'Hondt's bound is already the mean skip the search.

The bound, for sorted slot loads s_0 >= s_1 >= ... and m = 1..S: among the top
(m-1)R + 1 slots some rank holds m, and it fills its other S - m slots at least with
the S - m smallest slots, so max >= m * s_(m-1)R + (sum of the S - m smallest).

Only the 2X largest experts can change between candidates (X = extra slots), so the
candidates are built over that head; the rest are single-slot experts shared by all.

Shapes: C = candidates, L = layers, E = experts, H = head experts, X = extra slots,
R = ranks, S = slots per rank.
"""

from __future__ import annotations

import torch

_MAX_CANDIDATES = 65


def dhondt_counts(loads: torch.Tensor, num_slots: int, max_replicas: int) -> torch.Tensor:
    """[L, E] replicas per expert by D'Hondt, at most max_replicas each."""
    num_layers, num_experts = loads.shape
    extra = num_slots - num_experts
    counts = torch.ones(num_layers, num_experts, dtype=torch.int64)
    if extra > 0:
        picks = _dhondt_extras(loads.double(), extra, max_replicas)
        counts.scatter_add_(1, picks, torch.ones_like(picks))
    return counts


def choose_counts(loads: torch.Tensor, num_ranks: int, slots_per_rank: int,
                  tolerance: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """Replicas per expert: at least 1, at most R, summing to R * S per layer.

    Args:
        loads: [L, E] tokens per logical expert.
        num_ranks: R.
        slots_per_rank: S.
        tolerance: how far (relative) above the best bound a candidate may be and still
            be preferred for being closer to D'Hondt.
    Returns:
        counts: [L, E] int64.
        bound: [L] float64, the chosen counts' lower bound on max / mean rank load.
    """
    num_layers, num_experts = loads.shape
    num_slots = num_ranks * slots_per_rank
    extra = num_slots - num_experts
    if extra < 0 or num_slots > num_ranks * num_experts:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts at most once per rank")
    if extra == 0:
        ones = torch.ones(num_layers, num_experts, dtype=torch.int64)
        return ones, max_load_bound(loads, ones, num_ranks, slots_per_rank)
    w, ids = loads.double().sort(1, descending=True)  # [L, E] experts by load
    head = min(num_experts, 2 * extra)
    max_replicas = min(num_ranks, extra + 1)
    chosen = _candidates(w[:, :head], extra, max_replicas, torch.tensor([extra]))[0]  # [L, H] D'Hondt
    # Only layers where D'Hondt's bound exceeds the mean can gain from the search.
    bound = _lower_bound(w, chosen.unsqueeze(0), num_ranks, slots_per_rank)[0]
    bad = bound > 1 + tolerance
    if bool(bad.any()):
        chosen[bad], bound[bad] = _search(w[bad], head, extra, max_replicas, num_ranks, slots_per_rank, tolerance)
    out = torch.ones(num_layers, num_experts, dtype=torch.int64)
    return out.scatter_(1, ids[:, :head], chosen), bound


def _search(w: torch.Tensor, head: int, extra: int, max_replicas: int, num_ranks: int, slots_per_rank: int,
            tolerance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, H] head counts, [L] bound): the candidate with the largest x among those
    whose bound is within tolerance of the best, for loads w [L, E] sorted descending."""
    xs = torch.arange(extra + 1)
    if xs.numel() > _MAX_CANDIDATES:
        xs = torch.linspace(0, extra, _MAX_CANDIDATES).round().long().unique()
    counts = _candidates(w[:, :head], extra, max_replicas, xs)  # [C, L, H]
    # With few experts and many extras the halving step can run out of experts; such
    # candidates fall back to D'Hondt (the last one), which is always complete.
    short = (counts.sum(-1) != head + extra).unsqueeze(-1)
    counts = torch.where(short, counts[-1:], counts)
    bound = _lower_bound(w, counts, num_ranks, slots_per_rank)  # [C, L]
    near_best = bound <= bound.min(0).values * (1 + tolerance)
    pick = torch.where(near_best, xs.view(-1, 1), -1).argmax(0)  # [L] largest such x
    layer = torch.arange(w.shape[0])
    return counts[pick, layer], bound[pick, layer]


def max_load_bound(loads: torch.Tensor, counts: torch.Tensor, num_ranks: int, slots_per_rank: int) -> torch.Tensor:
    """[L] float64: no packing of these replica counts [L, E] onto R ranks of S slots can
    have a max rank load below bound * mean rank load (the bound of the module docstring)."""
    w, ids = loads.double().sort(1, descending=True)
    return _lower_bound(w, counts.gather(1, ids).unsqueeze(0), num_ranks, slots_per_rank)[0]


def _dhondt_extras(w: torch.Tensor, extra: int, max_replicas: int) -> torch.Tensor:
    """[L, X] expert of each extra slot in D'Hondt order, from loads w [L, E]."""
    if max_replicas < 2:
        raise ValueError("extra slots but max_replicas < 2")
    held = torch.arange(1, max_replicas, dtype=torch.float64)  # replicas before this one
    priority = (w.unsqueeze(-1) / held).flatten(1)  # [L, E * (max_replicas - 1)]
    return priority.topk(extra, dim=1).indices // (max_replicas - 1)


def _candidates(w: torch.Tensor, extra: int, max_replicas: int, xs: torch.Tensor) -> torch.Tensor:
    """[C, L, H] replica counts of the head experts w [L, H] (sorted descending)."""
    num_cands, (num_layers, head) = xs.numel(), w.shape
    order = _dhondt_extras(w, extra, max_replicas)  # [L, X]
    first = torch.arange(extra).view(1, 1, -1) < xs.view(-1, 1, 1)  # [C, 1, X]
    counts = torch.ones(num_cands, num_layers, head, dtype=torch.int64)
    counts.scatter_add_(2, order.expand(num_cands, -1, -1), first.expand(-1, num_layers, -1).long())
    untouched = counts == 1
    # w is sorted, so the first `extra - x` untouched experts are the largest untouched.
    place = torch.cumsum(untouched.long(), dim=2) - 1
    return counts + (untouched & (place < (extra - xs).view(-1, 1, 1))).long()


def _lower_bound(w: torch.Tensor, head_counts: torch.Tensor, num_ranks: int, slots_per_rank: int) -> torch.Tensor:
    """[C, L] lower bound on the max rank load over the mean, per candidate."""
    num_cands, num_layers, head = head_counts.shape
    w = w / (w.sum(1, keepdim=True) / num_ranks).clamp_min(1e-30)  # mean rank load 1, shares <= R
    share, order = (w[:, :head] / head_counts).sort(2, descending=True)  # [C, L, H]
    reps = head_counts.gather(2, order)
    per_row = int(reps[0, 0].sum())
    top = torch.repeat_interleave(share.flatten(), reps.flatten()).view(num_cands, num_layers, per_row)
    tail = w[:, head:]  # [L, T] single-slot experts, descending
    tail_len = tail.shape[1]
    # Merged position of each head slot: its index plus the tail slots strictly above it.
    # One flat search serves all layers: offsets larger than any share keep them apart.
    offset = (torch.arange(num_layers, dtype=torch.float64) * (2 * num_ranks + 2)).view(-1, 1)
    flat_tail = (tail.flip(1) + offset).flatten()
    at_or_below = torch.searchsorted(flat_tail, top + offset, right=True)
    at_or_below -= torch.arange(num_layers).view(-1, 1) * tail_len  # count within the layer
    merged_pos = torch.arange(per_row) + (tail_len - at_or_below)  # [C, L, A]
    few = min(slots_per_rank - 1, per_row + tail_len)
    smallest = torch.cat([top[..., per_row - min(few, per_row):],
                          tail[:, tail_len - min(few, tail_len):].expand(num_cands, -1, -1)], dim=2)
    small_sums = torch.cat([torch.zeros(num_cands, num_layers, 1, dtype=torch.float64),
                            smallest.sort(2).values[..., :few].cumsum(2)], dim=2)  # [C, L, few+1]
    bound = torch.ones(num_cands, num_layers, dtype=torch.float64)
    pad = torch.full((num_cands, num_layers, 1), -torch.inf, dtype=torch.float64)
    top_p = torch.cat([top, pad], 2)
    tail_p = torch.cat([tail.expand(num_cands, -1, -1), pad], 2)  # index tail_len reads -inf
    for m in range(1, slots_per_rank + 1):
        k = (m - 1) * num_ranks
        if k >= per_row + tail_len:
            break
        n_head = (merged_pos < k).sum(2, keepdim=True)  # head slots ranked above position k
        from_tail = (k - n_head).clamp(max=tail_len)
        s_k = torch.maximum(top_p.gather(2, n_head), tail_p.gather(2, from_tail)).squeeze(2)
        bound = torch.maximum(bound, m * s_k + small_sums[..., min(slots_per_rank - m, few)])
    return bound
