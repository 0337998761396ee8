"""Where a new request goes: its decode worker, its prefill worker, and the holders its
prefill worker may pull cached KV blocks from. Pure functions over heartbeats and the
KV index (KVIndex: which holder has which block, kept from the holders' KVEvents); the
mesh client owns the I/O, feeds the index, and keeps the counters passed in here.

Decode rule: the live worker with the least outstanding token load, where load is what
its last heartbeat reported plus what this gateway has sent it since. The second term
keeps a burst of requests from all landing on the worker that looked idle a moment
ago. Ties go to the worker with more free KV blocks. Keeping DP ranks at equal token
load keeps them in step.

Prefill rule: see pick_prefill (KV-aware) and route_prefill (plus the KV sources).
"""

from __future__ import annotations

from moemesh.shared.protocol.messages import Heartbeat, KVEvents, KVSource
from moemesh.shared.protocol.prefix_hash import chain

MAX_KV_SOURCES = 2


class KVIndex:
    """Which holder (prefill or decode worker, KV store) has which KV block, by content hash."""

    def __init__(self):
        self.blocks: dict[str, set[bytes]] = {}
        self.role: dict[str, str] = {}

    def apply(self, ev: KVEvents) -> None:
        held = self.blocks.setdefault(ev.holder_id, set())
        if ev.reset:
            held.clear()
        held.update(ev.stored)
        held.difference_update(ev.removed)
        self.role[ev.holder_id] = ev.role

    def forget(self, holder: str) -> None:
        self.blocks.pop(holder, None)
        self.role.pop(holder, None)

    def knows(self, holder: str) -> bool:
        return holder in self.blocks

    def overlap(self, holder: str, hashes: list[bytes]) -> int:
        """How many leading blocks of the hash chain the holder has."""
        held = self.blocks.get(holder)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


def pick_decode(workers: list[Heartbeat], assigned_since_beat: dict[str, int]) -> Heartbeat | None:
    """The least loaded decode worker, among those whose hand-offs are not failing if any
    (a worker whose KV pulls time out still serves its streams over NATS: its data plane,
    not the worker, is in trouble)."""
    workers = [w for w in workers if not w.handoffs_failing] or workers
    if not workers:
        return None
    return min(
        workers,
        key=lambda w: (w.load.outstanding_tokens + assigned_since_beat.get(w.worker_id, 0),
                       -w.load.num_free_blocks, w.worker_id),
    )


def pick_prefill(workers: list[Heartbeat], overlap: dict[str, int], block_size: int,
                 assigned_since_beat: dict[str, int], load_weight: float = 1.0) -> Heartbeat | None:
    """KV-aware choice of a prefill worker.

    Rule: maximise  cached_tokens(w) - load_weight * queued_prompt_tokens(w),
    where cached_tokens is the prompt prefix the worker already holds (blocks times
    block size) and queued_prompt_tokens is what its last heartbeat reported still to
    prefill plus what this gateway sent it since. A cached token saves exactly the work
    a queued token costs, so with load_weight 1 a request goes where its context lives
    unless that worker is busier by more than the context is long: requests of one
    session return to the worker that holds their growing prefix, and load still spreads.
    """
    if not workers:
        return None

    def score(w: Heartbeat) -> tuple:
        queued = w.load.pending_prompt_tokens + assigned_since_beat.get(w.worker_id, 0)
        return (overlap.get(w.worker_id, 0) * block_size - load_weight * queued, -queued, w.worker_id)

    return max(workers, key=score)


def route_prefill(prompt_ids: list[int], workers: list[Heartbeat], peers: list[Heartbeat], kv: KVIndex,
                  assigned_since_beat: dict[str, int]) -> tuple[Heartbeat | None, list[KVSource]]:
    """The prefill worker for a prompt (pick_prefill, over how much of the prompt each
    worker holds), and up to MAX_KV_SOURCES holders that have a longer prefix of it than
    that worker, longest first, to pull from.

    Args:
        workers: the live prefill workers.
        peers: every live holder (any role); only those with a kv_identity whose blocks
            the index knows count as holders.
        assigned_since_beat: prompt tokens sent to each prefill worker since its last beat.
    Returns:
        (None, []) when no prefill worker is alive.
    """
    if not workers:
        return None, []
    chains: dict[tuple[bytes, int], list[bytes]] = {}  # one hash chain per (identity, block size)
    overlap: dict[str, int] = {}
    holders = [hb for hb in peers if hb.kv_identity and kv.knows(hb.worker_id)]
    for hb in holders:
        if hb.role == "kv_store":
            continue
        key = (hb.kv_identity, hb.block_size)
        if key not in chains:
            usable = (len(prompt_ids) - 1) // hb.block_size  # the last token is always computed
            chains[key] = chain(prompt_ids, hb.block_size, hb.kv_identity, usable)
        overlap[hb.worker_id] = kv.overlap(hb.worker_id, chains[key])
    chosen = pick_prefill(workers, overlap, workers[0].block_size or 16, assigned_since_beat)
    ident = (chosen.kv_identity, chosen.block_size)
    mine_chain = chains.get(ident)
    if mine_chain is None:
        return chosen, []
    mine = overlap.get(chosen.worker_id, 0)
    for hb in holders:  # a store holds blocks of any model: the hashes themselves tell
        if hb.role == "kv_store":
            overlap[hb.worker_id] = kv.overlap(hb.worker_id, mine_chain)
    # Longest first; among holders as deep, the store first: serving a fetch costs a
    # worker's engine thread (the blocks are gathered between its steps), the store's nothing.
    ranked = sorted((hb for hb in holders
                     if overlap.get(hb.worker_id, 0) > mine and hb.worker_id != chosen.worker_id
                     and (hb.role == "kv_store" or (hb.kv_identity, hb.block_size) == ident)),
                    key=lambda hb: (-overlap[hb.worker_id], hb.role != "kv_store"))
    return chosen, [KVSource(hb.worker_id, overlap[hb.worker_id]) for hb in ranked[:MAX_KV_SOURCES]]
