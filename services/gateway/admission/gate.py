"""The admission order (order.py) on the event loop: each waiter waits on a future of its
own, for at most `wait_s`, or until its client goes. Every way out of a wait leaves the
queue or hands the slot on, so nothing is left behind: a wait that ends at the moment its
slot came gives that slot to the next waiter.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from moemesh.services.gateway.admission.order import AdmissionOrder, Outcome, Waiter

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
