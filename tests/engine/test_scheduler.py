import random

from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.shared.engine.scheduler import Scheduler, SchedulerConfig
from moemesh.shared.engine.sequence import FinishReason, SeqStatus, Sequence


def _seq(rid, n_prompt, max_tokens=4):
    return Sequence(rid, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0))


def _execute(sched: Scheduler, out) -> list[Sequence]:
    """Stand-in for the model: advance computed counts, append a token when caught up."""
    finished = []
    for s in out.scheduled:
        seq = s.seq
        seq.num_computed += s.num_new_tokens
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
                finished.append(seq)
    return finished


def test_token_budget_chunks_a_long_prompt():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), BlockManager(64, 16))
    seq = _seq("a", 80)
    sched.add(seq)
    sizes = []
    while seq.num_output_tokens == 0:
        out = sched.schedule()
        sizes.append(out.num_tokens)
        _execute(sched, out)
    assert sizes == [32, 32, 16]


def test_decode_goes_before_new_prefill_and_budget_is_shared():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), BlockManager(64, 16))
    a, b = _seq("a", 4), _seq("b", 20)
    sched.add(a)
    _execute(sched, sched.schedule())  # a prefills
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]


def test_preemption_frees_newest_and_recomputes():
    bm = BlockManager(4, 4)  # 16 token slots
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    a, b = _seq("a", 8, max_tokens=6), _seq("b", 8, max_tokens=6)
    sched.add(a)
    sched.add(b)
    _execute(sched, sched.schedule())  # both prefill: 2 blocks each, cache full
    assert bm.num_free_blocks == 0
    out = sched.schedule()  # a needs a 3rd block at position 8: b is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert b.status == SeqStatus.WAITING and b.num_computed == 0 and b.block_ids == []
    while sched.has_work():
        _execute(sched, sched.schedule())
    assert a.is_finished and b.is_finished and bm.num_free_blocks == 4
    assert b.num_preemptions >= 1


def test_abort_frees_everything_at_once():
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerConfig(), bm)
    seqs = [_seq(str(i), 9) for i in range(3)]
    for s in seqs:
        sched.add(s)
    _execute(sched, sched.schedule())
    for s in seqs:
        sched.finish(s, FinishReason.ABORT)
    assert bm.num_free_blocks == 16 and not sched.has_work()
    bm.check()


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=25),
    num_blocks=st.integers(4, 40),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 8),
    spec=st.integers(0, 2),
    seed=st.integers(0, 1000),
)
def test_random_traffic_never_leaks_and_always_finishes(arrivals, num_blocks, budget, max_seqs, spec, seed):
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(num_blocks, bs)
    sched = Scheduler(SchedulerConfig(max_seqs, budget, spec), bm)
    pending = []
    for i, (n_prompt, max_tok, delay) in enumerate(arrivals):
        # Only admit what can ever fit, as the engine does.
        if bm.blocks_for(n_prompt + max_tok + 2 * spec) > num_blocks:
            continue
        pending.append((delay, _seq(f"r{i}", n_prompt, max_tok)))
    all_seqs = [s for _, s in pending]
    for step in range(2000):
        for d, s in list(pending):
            if d <= step:
                sched.add(s)
                pending.remove((d, s))
        if not pending and not sched.has_work():
            break
        out = sched.schedule()
        _execute(sched, out)
        if sched.running and rng.random() < 0.05:
            victim = rng.choice(sched.running)
            sched.finish(victim, FinishReason.ABORT)
        bm.check()
        held = sum(len(s.block_ids) for s in sched.running)
        assert held == bm.num_used_blocks
        for s in sched.waiting:
            assert s.block_ids == [] or s.num_computed == 0
    assert not pending and not sched.has_work(), "a request never finished"
    assert bm.num_free_blocks == num_blocks
    assert all(s.is_finished for s in all_seqs)


def test_a_short_prompt_waits_one_step_behind_a_long_prefill_not_all_of_it():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(64, 16))
    long, short = _seq("long", 400), _seq("short", 10)
    sched.add(long)
    _execute(sched, sched.schedule())  # the long prompt's first chunk
    sched.add(short)
    out = sched.schedule()
    assert {s.seq.request_id: s.num_new_tokens for s in out.scheduled} == {"long": 54, "short": 10}


def test_short_prompts_never_take_more_than_half_the_budget_from_a_long_prefill():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockManager(128, 16))
    long = _seq("long", 400)
    sched.add(long)
    _execute(sched, sched.schedule())
    for i in range(6):
        sched.add(_seq(f"s{i}", 20))
    out = sched.schedule()
    got = {s.seq.request_id: s.num_new_tokens for s in out.scheduled}
    assert got["long"] == 32 and out.num_tokens == 64
    # a prompt longer than half the budget gets no reserve: the running prefill goes first
    sched2 = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(64, 16))
    sched2.add(_seq("long", 400))
    _execute(sched2, sched2.schedule())
    sched2.add(_seq("mid", 40))
    assert [s.num_new_tokens for s in sched2.schedule().scheduled] == [64]
