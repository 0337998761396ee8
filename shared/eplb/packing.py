"""Which rank holds which slot: the second half of our placement policy.

Given every slot's load (its expert's load over the expert's replica count), put
exactly S slots on each of R ranks so the heaviest rank is as light as possible, never
two replicas of one expert on one rank (that spends a slot for nothing), and do it for
all layers at once, as tensor operations over a layer batch:

1. rounds: sort slots heaviest first; in round j the R next slots go one to each rank,
   the heaviest slot to the lightest rank. S sorts in all, exactly S slots per rank.
2. deduplicate: while a rank holds an expert twice, swap one copy with the slot
   elsewhere that keeps the two ranks' max lowest.
3. pair exchange: pair the i-th heaviest rank with a light rank (the partner rotates
   each round so a stuck heavy rank meets every light one), and in every pair make the
   single swap that lowers the pair's max the most. Pairs are disjoint, so all swaps of
   a round apply at once. Where the heaviest rank's pair finds no swap, it searches
   every rank instead. Swapping stops once every rank is within `target` of the
   mean: beyond that a swap only fits the window's sampling noise, which the next
   window does not repeat.
4. second start: layers still above the bar after 1-3 are packed again from the
   greedy start (heaviest slot into the lightest rank with room, DeepSeek's packing),
   then 2-3, and keep whichever max is lower.

In warm mode steps 1 and 4 are skipped: the input already is the running placement,
with changed replica counts patched in, and every swap costs two expert copies.

Shapes: L = layers, R = ranks, S = slots per rank, P = R * S, Q = R // 2 pairs.
"""

from __future__ import annotations

import torch


def pack(share: torch.Tensor, experts: torch.Tensor, num_ranks: int, *, num_rounds: int = 24,
         target: float = 0.999, floor: torch.Tensor | None = None, warm: bool = False) -> torch.Tensor:
    """Arranges slots onto ranks.

    Args:
        share: [L, P] load of each slot.
        experts: [L, P] logical expert of each slot.
        num_ranks: R; P must be a multiple of it.
        num_rounds: most pair-exchange rounds.
        target: stop once every rank's load is under mean / target.
        floor: [L] a known lower bound on each layer's max rank load (without
            redundancy, the hottest expert's rank). Warm, reaching it stops the layer;
            cold, the other ranks keep evening out below it, since held out any of
            them may overtake the max (8 fewer of 252 grid scenarios behind DeepSeek).
        warm: the input order already is a placement (rank p // S): skip step 1 and
            only repair it, so few slots change.
    Returns:
        [L, P] order: position p of the result (rank p // S) takes input slot order[:, p].
    """
    num_layers, num_slots = share.shape
    start = torch.arange(num_slots).expand(num_layers, -1) if warm else _rounds(share, num_ranks)
    order, peak = _repair(share, experts, start, num_ranks, num_rounds, target, floor if warm else None)
    if warm or num_slots == num_ranks or num_ranks == 1:
        return order
    # Where the rounds left a layer above its bar, also start from the greedy packing
    # and keep the better. Rounds give every rank one slot per round, so the rank of
    # a dominant expert still takes mid-sized slots, and with many slots per rank
    # (K = 0, S = 64) swapping them out one by one takes ~100 rounds; greedy fills
    # that rank last, with the smallest slots, as DeepSeek's packing does.
    bar = _bar(share.view(num_layers, num_ranks, -1).sum(-1), target, floor).squeeze(1)
    todo = (peak > bar).nonzero().squeeze(1)
    if todo.numel():
        start = _greedy(share[todo], num_ranks)
        alt, alt_peak = _repair(share[todo], experts[todo], start, num_ranks, num_rounds, target, None)
        better = alt_peak < peak[todo]
        order[todo[better]] = alt[better]
    return order


def pack_greedy(share: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[L, P] order as pack() returns it, by DeepSeek's packing alone (heaviest slot into
    the lightest rank with room; no deduplication, no swaps), for the next-window choice
    (expected.py).

    share may be float32, as DeepSeek's rewrite computes it: slots are then taken in the
    order of the very sort call it makes, so slots of equal load (frequent with token
    counts, and of different experts next window) land on the same ranks as there."""
    by_load = share.sort(dim=1, descending=True).indices
    return _greedy(share.double(), num_ranks, by_load)


def _repair(share, experts, start, num_ranks, num_rounds, target, floor) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, P] order, [L] max rank load): steps 2 and 3 from the [L, P] start order."""
    num_layers, num_slots = share.shape
    per_rank = num_slots // num_ranks
    order = start.reshape(num_layers, num_ranks, per_rank).clone()  # [L, R, S]
    s, ex = share.gather(1, order.flatten(1)).view_as(order), experts.gather(1, order.flatten(1)).view_as(order)
    _deduplicate(s, ex, order)
    if per_rank > 1 and num_ranks > 1:
        _exchange(s, ex, order, num_rounds, target, floor)
    return order.flatten(1), s.sum(-1).amax(1)


def _bar(loads: torch.Tensor, target: float, floor: torch.Tensor | None) -> torch.Tensor:
    """[L, 1]: a rank at or under it needs no swap. loads: [L, R]."""
    bar = loads.mean(1, keepdim=True) / target
    if floor is not None:
        bar = torch.maximum(bar, floor.unsqueeze(1) * (1 + 1e-9))
    return bar


def _rounds(share: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[L, P] slot indices, rank-major: heaviest-first slots dealt to lightest-first ranks."""
    num_layers, num_slots = share.shape
    per_rank = num_slots // num_ranks
    by_load = share.sort(dim=1, descending=True, stable=True).indices  # [L, P]
    loads = torch.zeros(num_layers, num_ranks, dtype=share.dtype)
    out = torch.empty(num_layers, num_ranks, per_rank, dtype=torch.int64)
    for j in range(per_rank):
        dealt = by_load[:, j * num_ranks:(j + 1) * num_ranks]  # [L, R] heaviest first
        lightest = loads.argsort(dim=1, stable=True)  # [L, R]
        loads.scatter_add_(1, lightest, share.gather(1, dealt))
        out[:, :, j].scatter_(1, lightest, dealt)
    return out.flatten(1)


def _greedy(share: torch.Tensor, num_ranks: int, by_load: torch.Tensor | None = None) -> torch.Tensor:
    """[L, P] slot indices, rank-major: heaviest slot first into the lightest rank with room
    (DeepSeek's packing), one slot per step for all layers at once. by_load: [L, P] the
    slots heaviest first, if not by a stable sort of share."""
    num_layers, num_slots = share.shape
    per_rank = num_slots // num_ranks
    if by_load is None:
        by_load = share.sort(dim=1, descending=True, stable=True).indices  # [L, P]
    weight = share.gather(1, by_load)
    loads = torch.zeros(num_layers, num_ranks, dtype=share.dtype)  # +inf once a rank is full
    filled = torch.zeros(num_layers, num_ranks, dtype=torch.int64)
    rank_of = torch.empty(num_layers, num_slots, dtype=torch.int64)
    one = torch.ones(num_layers, 1, dtype=torch.int64)
    for i in range(num_slots):
        r = loads.argmin(1, keepdim=True)  # [L, 1] the first lightest rank with room
        rank_of[:, i:i + 1] = r
        loads.scatter_add_(1, r, weight[:, i:i + 1])
        filled.scatter_add_(1, r, one)
        loads.masked_fill_(filled == per_rank, torch.inf)
    # Every rank took exactly S slots; grouping by rank keeps each rank's in dealing order.
    return by_load.gather(1, rank_of.argsort(dim=1, stable=True))


def _deduplicate(s: torch.Tensor, ex: torch.Tensor, order: torch.Tensor) -> None:
    """Swaps in place until no rank holds an expert twice (if single swaps can get
    there, which they did in every case tried). s, ex, order: [L, R, S]."""
    num_layers, num_ranks, per_rank = s.shape
    num_experts = int(ex.max()) + 1
    earlier = torch.ones(per_rank, per_rank, dtype=torch.bool).tril(-1)  # [a, a'] a' < a
    layer = torch.arange(num_layers)
    rank_of = torch.arange(num_ranks).repeat_interleave(per_rank)  # [P]
    for attempt in range(2 * num_ranks * per_rank):
        dup = ((ex.unsqueeze(-1) == ex.unsqueeze(-2)) & earlier).any(-1).flatten(1)  # [L, P]
        num_dup = dup.sum(1)
        todo = num_dup > 0
        if not bool(todo.any()):
            return
        # Take the duplicates in turn: one may have no partner until another has moved.
        turn = attempt % num_dup.clamp_min(1) + 1
        at = (dup & (torch.cumsum(dup.long(), 1) == turn.unsqueeze(1))).long().argmax(1)  # [L]
        r, a = at // per_rank, at % per_rank
        present = torch.zeros(num_layers, num_ranks, num_experts, dtype=torch.bool)
        present.scatter_(2, ex, True)
        flat_ex, flat_s = ex.flatten(1), s.flatten(1)
        e_a, s_a = ex[layer, r, a], s[layer, r, a]  # [L]
        ok = ~present[layer, r].gather(1, flat_ex)  # partner's expert not on r
        ok &= ~present[layer.unsqueeze(1), rank_of, e_a.unsqueeze(1)]  # e_a not on partner's rank
        loads = s.sum(-1)
        cost = torch.maximum(loads[layer, r].unsqueeze(1) - s_a.unsqueeze(1) + flat_s,
                             loads[:, rank_of] - flat_s + s_a.unsqueeze(1))
        pick = cost.masked_fill(~ok, torch.inf).argmin(1)  # [L]
        go = todo & ok[layer, pick]
        _swap(s, ex, order, layer[go], r[go], a[go], pick[go] // per_rank, pick[go] % per_rank)
    # No single swap separates what is left: keep it. Two replicas on one rank waste a
    # slot but serve the same load, so the placement stays correct.


def _exchange(s, ex, order, num_rounds: int, target: float, floor: torch.Tensor | None) -> None:
    """Pair-exchange rounds, in place. s, ex, order: [L, R, S]."""
    num_ranks, per_rank = s.shape[1:]
    pairs = num_ranks // 2
    rotate = torch.arange(pairs)
    for t in range(num_rounds):
        loads = s.sum(-1)  # [L, R]
        bar = _bar(loads, target, floor)  # [L, 1]
        if bool((loads <= bar).all()):
            return
        ascending = loads.argsort(1)
        heavy, light = ascending[:, num_ranks - pairs:].flip(1), ascending[:, (rotate + t) % pairs]  # [L, Q]
        load_h, load_l = loads.gather(1, heavy), loads.gather(1, light)  # [L, Q]
        better = _best_swaps(s, ex, order, heavy, light, load_h, load_l, bar)
        # Where the heaviest rank's pair found nothing, it may still trade with a
        # mid-weight rank (with K = 0 the hottest expert's rank wants the smallest slots).
        stuck = ~better[:, 0] & (load_h[:, 0] > bar[:, 0])
        helped = bool(stuck.any()) and _heaviest_step(s, ex, order, stuck)
        if not helped and not bool(better.any()):
            return


def _best_swaps(s, ex, order, heavy, light, load_h, load_l, bar) -> torch.Tensor:
    """Each pair (heavy, light) [L, Q] makes its best single swap where that lowers the
    heavy rank over the bar; in place. Returns [L, Q] whether it swapped."""
    per_rank = s.shape[2]
    sh, sl = _rows(s, heavy), _rows(s, light)  # [L, Q, S]
    eq = _rows(ex, light).unsqueeze(-1) == _rows(ex, heavy).unsqueeze(-2)  # [L, Q, S(b), S(a)]
    clash = eq.any(-2).unsqueeze(-1) | eq.any(-1).unsqueeze(-2)  # [L, Q, S(a), S(b)] would duplicate
    moved = sh.unsqueeze(-1) - sl.unsqueeze(-2)  # load leaving the heavy rank
    new_h, new_l = load_h[..., None, None] - moved, load_l[..., None, None] + moved
    cost = torch.maximum(new_h, new_l).masked_fill_(clash, torch.inf)
    best, arg = cost.flatten(2).min(-1)  # [L, Q]
    # Only swaps that bring an over-the-bar rank down: the rest would fit noise, and
    # in warm mode each swap is two expert copies.
    better = (best < load_h * (1 - 1e-9)) & (load_h > bar)
    li, qi = better.nonzero(as_tuple=True)
    a, b = arg[li, qi] // per_rank, arg[li, qi] % per_rank
    _swap(s, ex, order, li, heavy[li, qi], a, light[li, qi], b)
    return better


def _heaviest_step(s, ex, order, layers: torch.Tensor) -> bool:
    """One swap in each chosen layer [L] between its heaviest rank and any other rank
    that lowers the heaviest; False if no layer has one."""
    num_layers, num_ranks, per_rank = s.shape
    layer = torch.arange(num_layers)
    loads = s.sum(-1)
    heavy = loads.argmax(1)  # [L]
    sh, eh = s[layer, heavy], ex[layer, heavy]  # [L, S]
    flat_s, flat_ex = s.flatten(1), ex.flatten(1)  # [L, P]
    rank_of = torch.arange(num_ranks).repeat_interleave(per_rank)  # [P]
    moved = sh.unsqueeze(-1) - flat_s.unsqueeze(1)  # [L, S(a), P(b)]
    load_h = loads[layer, heavy]
    cost = torch.maximum(load_h[:, None, None] - moved, loads[:, rank_of].unsqueeze(1) + moved)
    b_on_heavy = (flat_ex.unsqueeze(1) == eh.unsqueeze(2)).any(1)  # [L, P]
    a_on_rank = (ex.unsqueeze(1) == eh[:, :, None, None]).any(-1)  # [L, S, R]
    clash = b_on_heavy.unsqueeze(1) | a_on_rank[:, :, rank_of]  # [L, S, P]
    best, arg = cost.masked_fill_(clash, torch.inf).flatten(1).min(1)  # [L]
    go = (best < load_h * (1 - 1e-9)) & layers
    if not bool(go.any()):
        return False
    a, b = arg[go] // flat_s.shape[1], arg[go] % flat_s.shape[1]
    _swap(s, ex, order, layer[go], heavy[go], a, b // per_rank, b % per_rank)
    return True


def _rows(t: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """t [L, R, S] at ranks [L, Q] -> [L, Q, S]."""
    return t.gather(1, ranks.unsqueeze(-1).expand(-1, -1, t.shape[2]))


def _swap(s, ex, order, li, r1, a1, r2, a2) -> None:
    """Exchanges slot (r1, a1) with (r2, a2) in the listed layers, in all three tensors."""
    for t in (s, ex, order):
        first = t[li, r1, a1].clone()
        t[li, r1, a1] = t[li, r2, a2]
        t[li, r2, a2] = first
