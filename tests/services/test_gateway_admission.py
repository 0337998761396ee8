"""The gateway's admission by priority class: the pure order and its waits on the event
loop (admission/gate.py). No server: the gate's waits are driven by
releases and by cancellation, never by the clock, except the one test of the wait bound."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.services.gateway.admission.gate import AdmissionOrder, Gate, Outcome, Refused


def test_a_free_slot_is_taken_at_once_and_then_requests_queue():
    o = AdmissionOrder(num_slots=2, max_waiting=4)
    assert [o.arrive(0).outcome for _ in range(3)] == [Outcome.ADMITTED, Outcome.ADMITTED, Outcome.QUEUED]
    assert (o.num_inflight, o.num_waiting) == (2, 1)


def test_a_freed_slot_goes_to_the_best_class_then_the_earliest_arrival():
    o = AdmissionOrder(num_slots=1, max_waiting=8)
    o.arrive(0)
    names = {}
    for name, priority in (("low-a", 0), ("low-b", 0), ("high", -1), ("worst", 5), ("high-2", -1)):
        names[o.arrive(priority).waiter] = name
    order = [names[o.release()] for _ in range(5)]
    assert order == ["high", "high-2", "low-a", "low-b", "worst"]
    assert o.release() is None and o.num_inflight == 0


def test_a_full_queue_refuses_a_class_no_better_than_its_worst_and_displaces_for_a_better_one():
    o = AdmissionOrder(num_slots=1, max_waiting=2)
    o.arrive(0)
    a, b = o.arrive(0).waiter, o.arrive(0).waiter
    assert o.would_refuse(0) and o.arrive(0).outcome is Outcome.REFUSED
    assert not o.would_refuse(-1)
    high = o.arrive(-1)
    assert high.outcome is Outcome.QUEUED and high.displaced == b  # the worst class's latest arrival
    assert o.waiting() == [high.waiter, a]
    assert o.arrive(-1).displaced == a
    assert o.arrive(-1).outcome is Outcome.REFUSED  # nothing worse left to displace
    assert o.num_waiting == 2


def test_no_queue_refuses_at_once_when_every_slot_is_taken():
    o = AdmissionOrder(num_slots=1, max_waiting=0)
    assert o.arrive(3).outcome is Outcome.ADMITTED
    assert o.arrive(-1000).outcome is Outcome.REFUSED


def test_a_waiter_that_leaves_is_gone_and_one_already_admitted_is_told_so():
    o = AdmissionOrder(num_slots=1, max_waiting=4)
    o.arrive(0)
    a, b = o.arrive(0).waiter, o.arrive(0).waiter
    assert o.leave(a) and not o.leave(a)
    assert o.release() == b
    assert not o.leave(b)  # it had the slot by then: the caller gives it back
    assert o.num_waiting == 0 and o.num_inflight == 1


def test_reserved_slots_are_left_to_better_classes():
    o = AdmissionOrder(num_slots=3, max_waiting=4, reserve=1)  # classes below 0 may take the last slot
    assert [o.arrive(0).outcome for _ in range(2)] == [Outcome.ADMITTED, Outcome.ADMITTED]
    low = o.arrive(0)
    assert low.outcome is Outcome.QUEUED and o.num_inflight == 2  # the third slot is free, but reserved
    assert o.arrive(-1).outcome is Outcome.ADMITTED and o.num_inflight == 3  # at once, past the low waiter
    high = o.arrive(-1).waiter
    assert o.release() == high  # the best waiter first
    assert o.release() is None and o.num_inflight == 2  # the low waiter may not take what is left
    assert o.release() == low.waiter and o.num_inflight == 2
    assert AdmissionOrder(num_slots=2, max_waiting=1, reserve=1, reserve_below=5).arrive(4).outcome \
        is Outcome.ADMITTED
    with pytest.raises(ValueError):
        AdmissionOrder(num_slots=2, max_waiting=1, reserve=2)


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.just("arrive"), st.integers(-2, 2)), st.just(("release", 0)),
                              st.tuples(st.just("leave"), st.integers(0, 20))), max_size=60),
       num_slots=st.integers(1, 4), max_waiting=st.integers(0, 4), reserve=st.integers(0, 3))
def test_slots_are_never_lost_nor_doubled_and_nobody_waits_while_one_they_may_take_is_free(
        ops, num_slots, max_waiting, reserve):
    reserve = min(reserve, num_slots - 1)
    o = AdmissionOrder(num_slots, max_waiting, reserve)
    limit = lambda p: num_slots - (reserve if p >= 0 else 0)  # noqa: E731
    held, queued = 0, []
    for op, x in ops:
        if op == "arrive":
            a = o.arrive(x)
            assert (a.outcome is Outcome.ADMITTED) == (held < limit(x))
            if a.outcome is Outcome.ADMITTED:
                held += 1
            elif a.outcome is Outcome.QUEUED:
                queued.append(a.waiter)
                if a.displaced is not None:
                    assert a.displaced.priority > x and a.displaced == max(queued)
                    queued.remove(a.displaced)
        elif op == "release" and held:
            w = o.release()
            if w is None:
                held -= 1
                assert not queued or held >= limit(min(queued).priority)
            else:
                assert w == min(queued) and held - 1 < limit(w.priority)  # the best class's earliest
                queued.remove(w)
        elif op == "leave" and queued:
            w = queued[x % len(queued)]
            assert o.leave(w)
            queued.remove(w)
        assert o.num_inflight == held <= num_slots
        assert o.waiting() == sorted(queued) and len(queued) <= max_waiting
        assert all(held >= limit(w.priority) for w in queued)


# ---- the gate ---------------------------------------------------------------------------


def test_waiters_enter_by_class_as_slots_are_released():
    async def go():
        gate, entered = Gate(num_slots=1, max_waiting=8, wait_s=60), []
        await gate.enter(0)

        async def one(name: str, priority: int):
            await gate.enter(priority)
            entered.append(name)

        tasks = []
        for name, priority in (("low-a", 0), ("low-b", 0), ("high", -1)):
            tasks.append(asyncio.create_task(one(name, priority)))
            await asyncio.sleep(0)  # it has arrived before the next one does
        assert gate.num_waiting == 3
        for _ in range(3):
            gate.release()
        await asyncio.gather(*tasks)
        return entered, gate.inflight

    assert asyncio.run(go()) == (["high", "low-a", "low-b"], 1)


def test_a_displaced_waiter_is_refused_and_the_better_class_gets_the_slot():
    async def go():
        gate = Gate(num_slots=1, max_waiting=1, wait_s=60)
        await gate.enter(0)
        low = asyncio.create_task(gate.enter(0))
        await asyncio.sleep(0)
        high = asyncio.create_task(gate.enter(-1))
        with pytest.raises(Refused) as e:
            await low
        assert e.value.reason == "displaced"
        with pytest.raises(Refused) as e:
            await gate.enter(0)  # the queue is full of a better class
        assert e.value.reason == "full"
        gate.release()
        await high
        return gate.inflight, gate.num_waiting

    assert asyncio.run(go()) == (1, 0)


def test_a_client_gone_while_it_waits_leaves_the_queue():
    async def go():
        gate, left = Gate(num_slots=1, max_waiting=4, wait_s=60), asyncio.Event()
        await gate.enter(0)
        waiter = asyncio.create_task(gate.enter(0, left.wait))
        await asyncio.sleep(0)
        assert gate.num_waiting == 1
        left.set()
        with pytest.raises(Refused) as e:
            await waiter
        assert e.value.reason == "gone" and gate.num_waiting == 0
        cancelled = asyncio.create_task(gate.enter(0))  # its task cancelled: the same
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        gate.release()
        return gate.inflight, gate.num_waiting, len(gate._futures)

    assert asyncio.run(go()) == (0, 0, 0)


def test_a_slot_that_comes_as_its_waiter_gives_up_goes_on_to_the_next():
    async def go():
        gate = Gate(num_slots=1, max_waiting=4, wait_s=60)
        await gate.enter(0)
        first = asyncio.create_task(gate.enter(0))
        second = asyncio.create_task(gate.enter(0))
        await asyncio.sleep(0)
        gate.release()  # first's future is set, but first has not run yet
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await second  # the slot went on to it
        return gate.inflight, gate.num_waiting

    assert asyncio.run(go()) == (1, 0)


def test_nobody_waits_past_the_wait_and_closing_refuses_all_waiters():
    async def go():
        gate = Gate(num_slots=1, max_waiting=4, wait_s=0.01)
        await gate.enter(0)
        with pytest.raises(Refused) as e:
            await gate.enter(-1)
        assert e.value.reason == "waited" and gate.num_waiting == 0
        gate.wait_s = 60
        waiters = [asyncio.create_task(gate.enter(0)) for _ in range(2)]
        await asyncio.sleep(0)
        gate.close()
        reasons = []
        for w in waiters:
            with pytest.raises(Refused) as e:
                await w
            reasons.append(e.value.reason)
        return reasons, gate.inflight, gate.num_waiting

    assert asyncio.run(go()) == (["closed", "closed"], 1, 0)
