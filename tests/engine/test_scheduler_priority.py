"""Priority classes in the engine's scheduler: both queues go by (priority, arrival), and
preemption takes the worst class's newest sequence first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.scheduler import Scheduler, SchedulerConfig
from moemesh.shared.engine.sequence import SeqStatus, Sequence
from moemesh.shared.protocol.messages import SamplingParams
from tests.engine.test_scheduler import _execute


def _seq(rid: str, n_prompt: int, priority: int = 0, max_tokens: int = 2) -> Sequence:
    return Sequence(rid, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                               priority=priority))


def _first_scheduled(sched: Scheduler, seqs: list[Sequence], max_steps: int = 500) -> list[str]:
    """Request ids in the order a step first computed them, running to the end."""
    order: list[str] = []
    for _ in range(max_steps):
        if not sched.has_work():
            break
        out = sched.schedule()
        order += [s.seq.request_id for s in out.scheduled if s.seq.request_id not in order]
        _execute(sched, out)
    assert not sched.has_work() and all(s.is_finished for s in seqs)
    return order


def test_waiting_sequences_are_taken_by_class_then_arrival():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), BlockManager(64, 4))
    seqs = [_seq("low-a", 8), _seq("low-b", 8), _seq("high", 8, priority=-1), _seq("worst", 8, priority=5),
            _seq("high-2", 8, priority=-1)]
    for s in seqs:
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["high", "high-2", "low-a", "low-b", "worst"]
    assert _first_scheduled(sched, seqs) == ["high", "high-2", "low-a", "low-b", "worst"]


def test_a_high_class_arriving_late_goes_ahead_of_waiting_low_ones():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), BlockManager(64, 4))
    running, lows = _seq("running", 8), [_seq(f"low-{i}", 8) for i in range(3)]
    sched.add(running)
    _execute(sched, sched.schedule())
    for s in lows:
        sched.add(s)
    high = _seq("high", 8, priority=-2)
    sched.add(high)
    assert _first_scheduled(sched, [running, *lows, high]) == ["running", "high", "low-0", "low-1", "low-2"]


def test_preemption_takes_the_worst_class_first_even_when_it_is_older():
    bm = BlockManager(4, 4)  # 16 token slots
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    low, high = _seq("low", 8, max_tokens=6), _seq("high", 8, priority=-1, max_tokens=6)
    sched.add(low)
    sched.add(high)
    _execute(sched, sched.schedule())  # both prefill: 2 blocks each, cache full
    assert bm.num_free_blocks == 0 and [s.request_id for s in sched.running] == ["high", "low"]
    out = sched.schedule()  # high needs a 3rd block: low, the older, is preempted, not high
    assert [s.request_id for s in out.preempted] == ["low"]
    assert low.status == SeqStatus.WAITING and high.status == SeqStatus.RUNNING


def test_within_a_class_the_newest_is_preempted_and_goes_back_ahead_of_later_arrivals():
    bm = BlockManager(6, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64), bm)
    a, b, c = _seq("a", 8, max_tokens=6), _seq("b", 8, max_tokens=6), _seq("c", 8, max_tokens=6)
    for s in (a, b, c):
        sched.add(s)
    _execute(sched, sched.schedule())  # 2 blocks each: the cache is full
    late_low, late_high = _seq("late-low", 4), _seq("late-high", 4, priority=-1)
    sched.add(late_low)
    sched.add(late_high)
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["c"]
    # c keeps its arrival: ahead of the low that came after it, behind the better class
    assert [s.request_id for s in sched.waiting] == ["late-high", "c", "late-low"]


def test_imported_sequences_past_max_num_seqs_run_by_class():
    """The decode side: requests whose KV came from a prefill worker join `running`, which
    may hold more than a step takes; the step takes the best class first."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), BlockManager(64, 4))
    seqs = [_seq("low-a", 8), _seq("low-b", 8), _seq("high", 8, priority=-1)]
    for s in seqs:
        s.token_ids.append(1)  # the first token, sampled on the prefill worker
        s.num_computed = 8
        s.block_ids = sched.blocks.allocate(3)
        sched.add_running(s)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["high", "low-a"]


def test_a_better_class_takes_a_seat_from_a_worse_one_when_max_num_seqs_are_running():
    """An aggregated worker full of the default class: a better class starts at once,
    the worst class's newest is parked with its blocks, and it resumes where it stopped."""
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), bm)
    low_a, low_b = _seq("low-a", 8, max_tokens=8), _seq("low-b", 8, max_tokens=8)
    sched.add(low_a)
    sched.add(low_b)
    _execute(sched, sched.schedule())
    high = _seq("high", 8, priority=-1, max_tokens=2)
    sched.add(high)
    out = sched.schedule()
    # the batch was full of decodes: high is seated now and computes from the next step
    assert [s.seq.request_id for s in out.scheduled] == ["low-a", "low-b"] and not out.preempted
    assert [s.request_id for s in sched.running] == ["high", "low-a", "low-b"]
    _execute(sched, out)
    parked_blocks, parked_done = list(low_b.block_ids), low_b.num_computed
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["high", "low-a"] and not out.preempted
    assert low_b.status == SeqStatus.RUNNING and low_b.block_ids == parked_blocks
    _first_scheduled(sched, [low_a, low_b, high])
    assert low_b.num_computed >= parked_done and low_b.num_preemptions == 0
    assert bm.num_free_blocks == 64


def test_no_seat_is_taken_from_the_same_class_or_past_max_num_seqs_better_ones():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), BlockManager(64, 4))
    first = [_seq("high-a", 8, priority=-1), _seq("low", 8)]
    for s in first:
        sched.add(s)
    _execute(sched, sched.schedule())
    same, high_b, high_c = _seq("low-late", 8), _seq("high-b", 8, priority=-1), _seq("high-c", 8, priority=-1)
    for s in (same, high_b, high_c):
        sched.add(s)
    sched.schedule()
    # high-b takes low's seat; high-c would be a third of its class or better in two seats
    assert [s.request_id for s in sched.running] == ["high-a", "high-b", "low"]
    assert [s.request_id for s in sched.waiting] == ["high-c", "low-late"]


@settings(max_examples=40, deadline=None)
@given(priorities=st.lists(st.integers(-2, 2), min_size=1, max_size=12), num_blocks=st.integers(3, 12),
       max_seqs=st.integers(1, 3))
def test_every_request_finishes_and_each_class_starts_in_arrival_order(priorities, num_blocks, max_seqs):
    """All requests waiting at once, KV tight enough to preempt: each starts no earlier than
    any waiting better class allows, nothing leaks, and everything finishes."""
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16), bm)
    seqs = [_seq(f"r{i}", 6, p, max_tokens=3) for i, p in enumerate(priorities)]
    for s in seqs:
        sched.add(s)
    order = _first_scheduled(sched, seqs)
    rank = {s.request_id: (s.params.priority, s.arrival) for s in seqs}
    assert order == sorted(order, key=rank.__getitem__)
    assert bm.num_free_blocks == num_blocks
    bm.check()


@settings(max_examples=40, deadline=None)
@given(arrivals=st.lists(st.tuples(st.integers(0, 6), st.integers(-2, 2)), min_size=1, max_size=12),
       num_blocks=st.integers(4, 14), max_seqs=st.integers(1, 3))
def test_seats_taken_midway_leave_every_batch_within_max_num_seqs_and_leak_nothing(arrivals, num_blocks, max_seqs):
    """Requests of mixed classes arriving over several steps, KV tight: better classes take
    seats and worse ones are parked or preempted, yet no batch passes max_num_seqs,
    everything finishes and every block comes back."""
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16), bm)
    seqs = [_seq(f"r{i}", 6, p, max_tokens=4) for i, (_, p) in enumerate(arrivals)]
    for step in range(500):
        for s, (at, _) in zip(seqs, arrivals):
            if at == step:
                sched.add(s)
        if step > max(a for a, _ in arrivals) and not sched.has_work():
            break
        out = sched.schedule()
        assert len(out.scheduled) <= max_seqs
        _execute(sched, out)
    assert all(s.is_finished for s in seqs)
    assert bm.num_free_blocks == num_blocks
    bm.check()
