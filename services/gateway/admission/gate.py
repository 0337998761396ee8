"""Who gets an in-flight slot, and in what order (AdmissionOrder: pure, no I/O, no clock),
and the waits for one on the event loop (Gate).

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

On the event loop each waiter waits on a future of its own, for at most `wait_s`, or until
its client goes. Every way out of a wait leaves the queue or hands the slot on, so nothing
is left behind: a wait that ends at the moment its slot came gives that slot to the next
waiter.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import itertools
import time
from dataclasses import dataclass
from typing import Awaitable, Callable


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


# What a waiter's future is set to.
_ADMITTED, _DISPLACED, _CLOSED = "admitted", "displaced", "closed"


class Refused(Exception):
    """Not admitted. reason: full (no place in the queue), waited (no slot within the
    wait), displaced (a better class took its place), closed (the gateway is draining) or
    gone (the client left while it waited)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Gate:
    def __init__(self, num_slots: int, max_waiting: int, wait_s: float, reserve: int = 0, reserve_below: int = 0):
        """See AdmissionOrder for the slots, the queue and the reserve."""
        self.order = AdmissionOrder(num_slots, max_waiting, reserve, reserve_below)
        self.wait_s = wait_s
        self._futures: dict[Waiter, asyncio.Future] = {}

    @property
    def inflight(self) -> int:
        return self.order.num_inflight

    @property
    def num_waiting(self) -> int:
        return self.order.num_waiting

    def hopeless(self) -> bool:
        """Whether even the best class arriving now would be refused: then the request is
        refused before its body is read."""
        return self.order.would_refuse(-(1 << 62))

    async def enter(self, priority: int, gone: Callable[[], Awaitable] | None = None) -> float:
        """Take a slot, waiting for one in class order. gone: called only if the request
        waits, gives what completes when the client leaves (cancelled here once the wait
        ends). Returns the seconds waited. Raises Refused; a slot taken is given back with
        release()."""
        a = self.order.arrive(priority)
        if a.outcome is Outcome.ADMITTED:
            return 0.0
        if a.outcome is Outcome.REFUSED:
            raise Refused("full")
        if a.displaced is not None:
            self._settle(a.displaced, _DISPLACED)
        t0 = time.monotonic()
        fut = asyncio.get_running_loop().create_future()
        self._futures[a.waiter] = fut
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            await asyncio.wait([f for f in (fut, watch) if f is not None], timeout=self.wait_s,
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task was cancelled while it waited
            self._give_up(a.waiter, fut)
            raise
        finally:
            if watch is not None:
                watch.cancel()
        left = watch is not None and watch.done() and not watch.cancelled()
        if fut.done() and fut.result() == _ADMITTED and not left:
            return time.monotonic() - t0
        self._give_up(a.waiter, fut)
        raise Refused("gone" if left else fut.result() if fut.done() else "waited")

    def release(self) -> None:
        """An admitted request's slot is given back: to the best waiter, if any."""
        w = self.order.release()
        if w is not None:
            self._settle(w, _ADMITTED)

    def close(self) -> None:
        """Refuse everyone waiting (the gateway drains); those in flight go on."""
        for w in self.order.clear():
            self._settle(w, _CLOSED)

    def _settle(self, w: Waiter, result: str) -> None:
        fut = self._futures.pop(w)
        if not fut.done():
            fut.set_result(result)

    def _give_up(self, w: Waiter, fut: asyncio.Future) -> None:
        """A wait ends unadmitted: out of the queue, or, where its slot came meanwhile, the
        slot on to the next waiter."""
        if self.order.leave(w):
            del self._futures[w]
        elif fut.done() and fut.result() == _ADMITTED:
            self.release()
