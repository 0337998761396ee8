"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Order: by class, then arrival. A sequence's class is its request's priority
(SamplingParams.priority, vLLM's: lower is served earlier); within a class the earlier
arrival goes first. Both queues are kept in that order (`_rank`).

Each step: running sequences first, in that order (decode tokens and draft tokens to
verify, or the next prefill chunk), then waiting sequences in that order while the
budget and free blocks last. A running prefill chunk leaves room (at most half the
budget) for the short prompts at the head of the queue: a later turn of a conversation,
whose prefix is cached, then waits one step behind another's long cold prompt rather
than for the whole of it. When max_num_seqs are running, a waiting sequence of a better
class than some of them still joins them (`_takes_a_seat`): the worst class's newest are
parked past max_num_seqs with their blocks, so a better class's first token waits a step,
not for a worse class's answer. When a running sequence cannot get the blocks it needs,
the last running sequence is preempted, the worst class's newest: its blocks are freed
and it will be recomputed from its tokens. This keeps the best and oldest requests moving.

Parallel sampling (engine/fork.py): a parent counts as the n sequences it forks into,
against max_num_seqs, from the step it is admitted; its chunks end one position short of
its prompt, where the engine forks it (`fork`). On V4 it also takes its children's n
rings at admission (its own and `fork_rings`): the fork then needs no free ring.

DeepSeek-V4 (with `snapshots`): a cached prefix is taken only as deep as its deepest
boundary snapshot, whose copy into the sequence's ring goes with its first step, and a
prefill chunk ends at each boundary the sequence is to snapshot (engine/snapshots.py).

While a step is in flight (the engine plans step N+1 during step N), a sequence that N
samples for already ends in a placeholder token, and the scheduler plans N+1 as if N had
landed. A sequence whose placeholder is its last token by length (past `last_slot`) is
left out, and nothing is preempted then (`can_preempt=False`): the plan reports
`blocked` and the engine waits for N to land before it schedules again.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.runner import Chunk
from moemesh.shared.engine.sequence import FinishReason, SeqStatus, Sequence
from moemesh.shared.engine.snapshots import SnapshotCache, targets, usable_depth


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    num_spec_tokens: int = 0  # draft tokens verified per decode step

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_spec_tokens < 0:
            raise ValueError("num_spec_tokens must be >= 0")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, draft tokens included
    num_draft_tokens: int = 0

    @property
    def start(self) -> int:
        return self.seq.num_computed

    def chunk(self) -> Chunk:
        """What the step computes of it: its next tokens, then the drafts it verifies."""
        seq = self.seq
        if self.num_new_tokens == 1 and not self.num_draft_tokens:
            return Chunk(seq, seq.num_computed, [seq.token_ids[seq.num_computed]])
        n_real = self.num_new_tokens - self.num_draft_tokens
        ids = seq.token_ids[seq.num_computed : seq.num_computed + n_real] + seq.draft_ids[: self.num_draft_tokens]
        return Chunk(seq, seq.num_computed, ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocked: bool = False  # a running sequence needs blocks that only a preemption would free

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


def _rank(seq: Sequence) -> tuple[int, int]:
    """Where a sequence goes in either queue: its class, then its arrival."""
    return seq.params.priority, seq.arrival


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, snapshots: SnapshotCache | None = None):
        self.cfg = cfg
        self.blocks = blocks
        self.snapshots = snapshots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._parents: dict[str, Sequence] = {}  # running parents that have not forked yet

    # ---- queue management --------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into `waiting` at its rank: at the end for the common case of one class."""
        if not self.waiting or _rank(self.waiting[-1]) <= _rank(seq):
            self.waiting.append(seq)
        else:
            bisect.insort(self.waiting, seq, key=_rank)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in the cache (imported from a prefill worker)."""
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running, seq, key=_rank)  # in order, without a sort per import

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status == SeqStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
            self._parents.pop(seq.request_id, None)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def detach(self, seq: Sequence) -> None:
        """Take a running sequence out of scheduling but keep its blocks (HELD)."""
        self.running.remove(seq)
        seq.status = SeqStatus.HELD

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """The running parent's children take its place (they share its arrival and class)."""
        i = self.running.index(parent)
        self.running[i : i + 1] = children
        self._parents.pop(parent.request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------
    def schedule(self, can_preempt: bool = True) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        k = self.cfg.num_spec_tokens
        reserve = self._short_waiting(budget // 2) if len(self.running) < self.cfg.max_num_seqs else 0
        bs, extra = self.blocks.block_size, max(k - 1, 0)
        running, scheduled = self.running, out.scheduled
        i = 0
        # Imported sequences join `running` directly (add_running), so `running` can hold
        # more than max_num_seqs: the batch takes the oldest, the rest wait their turn.
        while i < len(running) and budget > 0 and len(scheduled) < self.cfg.max_num_seqs:
            seq = running[i]
            n_tok = len(seq.token_ids)
            if n_tok > seq.last_slot or seq.hold_step >= 0:  # its last token, or what decides its next, is in flight
                i += 1
                continue
            done = seq.num_computed
            if n_tok - done == 1 and not seq.draft_ids and (done + extra) // bs < len(seq.block_ids):
                scheduled.append(ScheduledSeq(seq, 1))  # a decode token with its slot in place: the bulk
                budget -= 1
                i += 1
                continue
            # The same with its drafts to verify (MTP), when the slots for them are in place
            # too and nothing would cut the chunk (the budget, forks, snapshot targets).
            nd = len(seq.draft_ids)
            if n_tok - done == 1 and nd and (done + nd + extra) // bs < len(seq.block_ids) and nd < budget \
                    and not seq.forks and not seq.snap_targets and n_tok > seq.num_prompt_tokens:
                scheduled.append(ScheduledSeq(seq, 1 + nd, nd))
                budget -= 1 + nd
                i += 1
                continue
            num_new = n_tok - done
            drafts = 0
            if seq.in_decode and seq.draft_ids:
                drafts = min(len(seq.draft_ids), budget - 1)
                num_new += drafts
            elif not seq.in_decode and num_new > budget - reserve:
                num_new = max(budget - reserve, 1)  # a prefill chunk: the reserve goes to short prompts
            num_new = self._cut(seq, min(num_new, budget))
            if not can_preempt and not self.blocks.can_allocate(
                    self.blocks.blocks_for(seq.num_computed + num_new + max(k - 1, 0)) - len(seq.block_ids)):
                out.blocked = True
                return out
            if not self._ensure_blocks(seq, seq.num_computed + num_new + max(k - 1, 0), out):
                if seq.status != SeqStatus.RUNNING:  # preempted itself
                    continue
                break
            out.scheduled.append(ScheduledSeq(seq, num_new, drafts))
            budget -= num_new
            i += 1

        # A parent not forked yet holds the places of its children.
        num_seqs = len(self.running) + sum(len(p.forks) - 1 for p in self._parents.values())
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            width = max(1, len(seq.forks))
            if num_seqs + width > self.cfg.max_num_seqs and not self._takes_a_seat(seq, width):
                break
            cached = self._reuse_prefix(seq)
            num_new = self._cut(seq, min(seq.num_tokens - seq.num_computed, budget))
            need = self.blocks.blocks_for(seq.num_computed + num_new + max(k - 1, 0)) - len(seq.block_ids)
            rings = width if self.blocks.uses_rings and seq.ring < 0 else 0
            if rings > self.blocks.num_free_rings or not self.blocks.can_allocate(need):
                if cached:  # give the prefix back; it stays cached for the next attempt
                    self._free(seq)
                    seq.num_computed = seq.num_registered = 0
                break
            seq.block_ids += self.blocks.allocate(need)
            if rings:
                seq.ring = self.blocks.take_ring()
                seq.fork_rings = [self.blocks.take_ring() for _ in range(rings - 1)]
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=_rank)  # a preempted sequence goes back to its place
            num_seqs += width
            if seq.forks:
                self._parents[seq.request_id] = seq
            if len(scheduled) + width > self.cfg.max_num_seqs:
                # It took a seat from a worse class, and this step's batch is full: its
                # first chunk goes with the next step, where it ranks ahead of that class.
                break
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def _takes_a_seat(self, seq: Sequence, width: int) -> bool:
        """Whether a waiting sequence may join `running` although max_num_seqs are there: its
        class is better than some of theirs, and it would be among the first max_num_seqs by
        class. The worst class's sequences past max_num_seqs are then parked (they keep their
        blocks and wait their turn, as imports past max_num_seqs do), so a better class's
        first token never waits for a worse class's whole answer."""
        p = seq.params.priority
        as_good = bisect.bisect_right(self.running, (p, float("inf")), key=_rank)
        return as_good < len(self.running) and as_good + width <= self.cfg.max_num_seqs

    def _short_waiting(self, limit: int) -> int:
        """Tokens that the sequences at the head of the queue have left to prefill (after
        their cached prefix), counted while each has at most `limit` and up to `limit` in all."""
        total = 0
        for seq in self.waiting:
            left = seq.num_tokens - seq.num_computed - len(self._cached_prefix(seq)[0]) * self.blocks.block_size
            if left > limit:
                break
            total += left
            if total >= limit:
                break
        return min(total, limit)

    def _reuse_prefix(self, seq: Sequence) -> int:
        """Start a fresh sequence on the cached blocks of its longest known prefix. At least
        one token is left to compute, since sampling needs its logits."""
        fresh = not seq.block_ids and not seq.num_computed
        blocks, num_cached = self._cached_prefix(seq)
        if blocks:
            self.blocks.acquire(blocks)
            seq.block_ids = list(blocks)
            seq.num_computed = len(blocks) * self.blocks.block_size
            seq.num_registered = len(blocks)
            seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed)
            if self.snapshots is not None:
                self.pin_snapshot(seq)
        if self.snapshots is not None and (fresh or seq.restore_ring >= 0):
            seq.snap_targets = targets(seq.num_computed, num_cached, seq.num_tokens, self.blocks.block_size)
        return len(blocks)

    def pin_snapshot(self, seq: Sequence) -> None:
        """A V4 sequence that starts on cached blocks: its ring is restored from the
        snapshot at their end before its first step."""
        h = seq.block_hashes[len(seq.block_ids) - 1]
        seq.restore_ring, seq.restore_hash = self.snapshots.pin(h), h

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """Cached blocks a fresh sequence could start on (no references taken), and how
        many are cached (V4: more than it can start on where snapshots are missing); at
        least one token is left to compute, since sampling needs its logits."""
        if seq.block_ids or seq.num_computed or not self.blocks.enable_caching or seq.prompt_logprobs is not None:
            return [], 0  # a scored prompt computes every position (engine/prompt_scores.py)
        # A parent's own last position to compute is P-2 (its children compute P-1).
        usable = (seq.num_tokens - (2 if seq.forks else 1)) // self.blocks.block_size
        blocks = self.blocks.lookup(seq.block_hashes[:usable])
        # Only a V4 engine has snapshots (one without them caches nothing, so finds nothing).
        return blocks[: usable_depth(self.snapshots, seq.block_hashes[: len(blocks)], self.snapshots is not None)], \
            len(blocks)

    @staticmethod
    def _cut(seq: Sequence, num_new: int) -> int:
        """End a prefill chunk at the next boundary the sequence snapshots, and a parent's
        at its last position but one, where it forks."""
        if seq.forks:
            num_new = min(num_new, seq.num_tokens - 1 - seq.num_computed)
        for t in seq.snap_targets:
            if t > seq.num_computed:
                return min(num_new, t - seq.num_computed)
        return num_new

    def _ensure_blocks(self, seq: Sequence, num_slots: int, out: SchedulerOutput) -> bool:
        need = self.blocks.blocks_for(num_slots) - len(seq.block_ids)
        while need > self.blocks.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_ids += self.blocks.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._parents.pop(seq.request_id, None)
        self._free(seq)
        seq.num_computed = 0
        seq.num_registered = 0
        seq.draft_ids = []
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)  # ahead of the later arrivals of its class, behind any better class

    def _free(self, seq: Sequence) -> None:
        if seq.restore_ring >= 0:  # it never ran: the snapshot it was to start from is not needed
            self.snapshots.unpin(seq.restore_hash)
            seq.restore_ring, seq.restore_hash = -1, b""
        if seq.block_ids:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []
        if seq.cow_src >= 0:  # a child that never ran: the tail block it was to copy
            self.blocks.free([seq.cow_src])
            seq.cow_src = -1
        if seq.ring >= 0:
            self.blocks.give_ring(seq.ring)
            seq.ring = -1
        for r in seq.fork_rings:  # a V4 parent's rings for its children
            self.blocks.give_ring(r)
        seq.fork_rings = []
