"""Who gets an in-flight slot, and in what order. Pure: no I/O, no clock.

Glossary:
- slot: what an admitted request holds while it is in flight; there are max_inflight.
- class: a request's priority (vLLM's): lower is served earlier.
- waiter: a request queued for a slot, named by (class, arrival number).
- reserve: the last `reserve` slots, which only classes better than `reserve_below` may
  take. The others stop short of them, so that a better class arriving finds a slot at
  once instead of waiting for one to be given back.

A request that finds a slot it may take takes it. One that finds none waits, in a bounded
queue ordered by class and then arrival. A slot given back goes to the best class's
earliest waiter if it may take it, so nobody waits while a slot they may take is free.
When the queue is full, a newcomer of a better class than the worst waiter takes that
waiter's place (the worst class's latest arrival, which is refused); any other newcomer
is refused. A waiter that gives up (its wait is over, its client gone) just leaves.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Waiter:
    priority: int
    arrival: int


class Outcome(enum.Enum):
    ADMITTED = "admitted"  # a slot was free: it is the request's now
    QUEUED = "queued"  # it waits for one
    REFUSED = "refused"  # the queue is full of classes as good as its own, or better


@dataclass(frozen=True)
class Arrival:
    outcome: Outcome
    waiter: Waiter | None = None  # QUEUED: its place
    displaced: Waiter | None = None  # QUEUED: the waiter whose place it took, refused now


class AdmissionOrder:
    def __init__(self, num_slots: int, max_waiting: int, reserve: int = 0, reserve_below: int = 0):
        """num_slots: requests in flight at most; max_waiting: requests queued at most (0:
        a request that finds no slot free is refused at once); reserve: slots that only
        classes below reserve_below (better than it) may take."""
        if num_slots < 1 or max_waiting < 0 or not 0 <= reserve < num_slots:
            raise ValueError("num_slots must be >= 1, max_waiting >= 0 and reserve in [0, num_slots)")
        self.num_slots, self.max_waiting = num_slots, max_waiting
        self.reserve, self.reserve_below = reserve, reserve_below
        self.num_inflight = 0
        self._waiting: list[Waiter] = []  # best first
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[Waiter]:
        """The queue, best first."""
        return list(self._waiting)

    def limit(self, priority: int) -> int:
        """Slots a class may see taken and still take one more."""
        return self.num_slots if priority < self.reserve_below else self.num_slots - self.reserve

    def would_refuse(self, priority: int) -> bool:
        """Whether a request of this class arriving now would be refused at once."""
        if self.num_inflight < self.limit(priority) or len(self._waiting) < self.max_waiting:
            return False
        return not self._waiting or self._waiting[-1].priority <= priority

    def arrive(self, priority: int) -> Arrival:
        # A slot it may take is free: every waiter is of a class that may not take it (a
        # waiter waits only while no slot it may take is free), so it overtakes nobody of
        # its own class or better.
        if self.num_inflight < self.limit(priority):
            self.num_inflight += 1
            return Arrival(Outcome.ADMITTED)
        if self.would_refuse(priority):
            return Arrival(Outcome.REFUSED)
        displaced = self._waiting.pop() if len(self._waiting) >= self.max_waiting else None
        w = Waiter(priority, next(self._arrivals))
        bisect.insort(self._waiting, w)
        return Arrival(Outcome.QUEUED, w, displaced)

    def release(self) -> Waiter | None:
        """A slot is given back. Returns the waiter it goes to (None: the slot is free).
        Only the head can be the one: the best class's limit is the highest."""
        if self._waiting and self.num_inflight - 1 < self.limit(self._waiting[0].priority):
            return self._waiting.pop(0)
        self.num_inflight -= 1
        return None

    def leave(self, w: Waiter) -> bool:
        """A waiter gives up. Returns whether it was still waiting; False: it was handed a
        slot or displaced before it gave up."""
        i = bisect.bisect_left(self._waiting, w)
        if i < len(self._waiting) and self._waiting[i] == w:
            del self._waiting[i]
            return True
        return False

    def clear(self) -> list[Waiter]:
        """Everyone waiting leaves (the gateway is shutting down); returns them."""
        out, self._waiting = self._waiting, []
        return out
