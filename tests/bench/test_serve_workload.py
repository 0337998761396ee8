"""Request streams: reproducible from the seed, lengths as asked, sessions that grow."""

from __future__ import annotations

import asyncio
import random

import pytest

from moemesh.tools.bench.serve import runner
from moemesh.tools.bench.serve import workload as wl
from moemesh.tools.bench.serve.workload import LengthDist, WorkloadConfig


def _stream(w: wl.Workload) -> list:
    return [(s.session, s.group, [(t.text, t.input_len, t.max_tokens) for t in s.turns], a)
            for s, a in zip(w.sessions, w.arrivals)]


@pytest.mark.parametrize("kind", ["random", "prefix", "agentic"])
def test_same_seed_same_stream_other_seed_other_stream(kind):
    cfg = WorkloadConfig(kind=kind, num_requests=20, num_sessions=5, turns=LengthDist.parse("uniform:2-5"),
                         prefix_len=32, isl=LengthDist.parse("uniform:8-64"), tool_len=LengthDist.parse("16"))
    a, b, c = wl.build(cfg, seed=1), wl.build(cfg, seed=1), wl.build(cfg, seed=2)
    assert _stream(a) == _stream(b)
    assert _stream(a) != _stream(c)
    assert [t.text for s in a.sessions for t in s.turns] != [t.text for s in c.sessions for t in s.turns]
    assert a.arrivals != c.arrivals


def test_salt_changes_text_only():
    cfg = WorkloadConfig(num_requests=10)
    a, b = wl.build(cfg, seed=3, salt=0), wl.build(cfg, seed=3, salt=1)
    shape = lambda w: [(t.input_len, t.max_tokens) for s in w.sessions for t in s.turns]  # noqa: E731
    assert shape(a) == shape(b) and a.arrivals == b.arrivals
    assert all(x.turns[0].text != y.turns[0].text for x, y in zip(a.sessions, b.sessions))


def test_lengths_follow_the_spec_without_a_tokenizer():
    cfg = WorkloadConfig(kind="fixed", num_requests=5, isl=LengthDist.parse("40"), osl=LengthDist.parse("7"),
                         words_per_token=0.5)
    w = wl.build(cfg, seed=0)
    for s in w.sessions:
        (t,) = s.turns
        assert (t.input_len, t.max_tokens, len(t.text.split())) == (40, 7, 20)


def test_arrivals_are_a_unit_rate_poisson_process():
    w = wl.build(WorkloadConfig(num_requests=2000, isl=LengthDist.parse("1"), osl=LengthDist.parse("1")), seed=0)
    gaps = [b - a for a, b in zip(w.arrivals, w.arrivals[1:])]
    assert w.arrivals[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1.0, rel=0.1)


def test_length_specs():
    rng = random.Random(0)
    u = LengthDist.parse("uniform:10-20")
    assert all(10 <= u.sample(rng) <= 20 for _ in range(200))
    assert all(LengthDist.parse("normal:5,50").sample(rng) >= 1 for _ in range(200))
    assert LengthDist.parse("lognormal:100,0").sample(rng) == 100
    assert str(LengthDist.parse("uniform:10-20")) == "uniform:10-20"
    for bad in ("uniform:20-10", "normal:5", "poisson:3", "x", "0"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)
    with pytest.raises(ValueError):
        WorkloadConfig(kind="fixed", isl=u)


def test_prefix_groups_share_their_prefix():
    cfg = WorkloadConfig(kind="prefix", num_requests=12, num_prefix_groups=3, prefix_len=50,
                         isl=LengthDist.parse("10"))
    w = wl.build(cfg, seed=0)
    prefixes = {}
    for s in w.sessions:
        prefixes.setdefault(s.group, []).append(s.turns[0].text)
    assert sorted(prefixes) == [0, 1, 2]
    heads = {g: " ".join(texts[0].split()[:50]) for g, texts in prefixes.items()}
    assert len(set(heads.values())) == 3
    for g, texts in prefixes.items():
        assert all(t.startswith(heads[g] + " ") for t in texts)
        assert len(set(texts)) == len(texts)  # unique suffixes


def test_tokenizer_calibrates_lengths(tmp_path):
    from moemesh.shared.checkpoint.tokenizer_builder import build_tokenizer

    # A small byte-level BPE splits most words into pieces: a hard case for calibration.
    build_tokenizer(512).save(str(tmp_path / "tokenizer.json"))
    tok = wl.load_tokenizer(tmp_path)
    src = wl.TextSource(random.Random(0), tok)
    for n in (1, 7, 123, 431):
        got = len(tok.encode(src.text(n), add_special_tokens=False).ids)
        assert abs(got - n) <= 1, (n, got)
    with pytest.raises(ValueError):
        wl.load_tokenizer(tmp_path / "missing")


class FakeClient:
    """Answers every request at once with a text naming the turn, and records messages."""

    def __init__(self, delay_s: float = 0.0):
        self.sent, self.inflight, self.max_inflight, self.delay_s = [], 0, 0, delay_s
        self.loop_t0 = 0.0

    def reset_clock(self):
        self.loop_t0 = asyncio.get_running_loop().time()

    def now(self):
        return asyncio.get_running_loop().time() - self.loop_t0

    async def send(self, rec, messages, prompt_ids=None):
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        rec.start = self.now()
        self.sent.append((rec, [dict(x) for x in messages]))
        await asyncio.sleep(self.delay_s)
        rec.text = f" answer of session {rec.session} turn {rec.turn}."
        rec.chunk_times, rec.chunk_tokens, rec.output_tokens = [self.now()], [3], 3
        rec.end = self.now()
        self.inflight -= 1


def test_agentic_context_grows_turn_by_turn():
    cfg = WorkloadConfig(kind="agentic", num_sessions=3, turns=LengthDist.parse("4"),
                         isl=LengthDist.parse("30"), tool_len=LengthDist.parse("10"))
    work = wl.build(cfg, seed=0)
    client = FakeClient()
    records = asyncio.run(runner.run_point(client, work, "concurrency", 2))
    assert [r.index for r in records] == list(range(12))
    by_session = {}
    for rec, msgs in client.sent:
        by_session.setdefault(rec.session, []).append((rec, msgs))
    for turns in by_session.values():
        assert [r.turn for r, _ in turns] == [1, 2, 3, 4]
        for (r0, m0), (r1, m1) in zip(turns, turns[1:]):
            # chat: the next context is this one plus the answer plus a new user message
            assert m1[:len(m0)] == m0
            assert m1[len(m0)] == {"role": "assistant", "content": r0.text}
            assert len(m1) == len(m0) + 2 and m1[-1]["role"] == "user"
            # completions: the next prompt starts with this prompt followed by its answer
            p0, p1 = wl.render_completion(m0), wl.render_completion(m1)
            assert p1.startswith(p0 + r0.text) and len(p1) > len(p0 + r0.text)
            assert r1.target_input_tokens == r0.target_input_tokens + 3 + 10


def test_concurrency_is_held_and_rate_spaces_arrivals():
    work = wl.build(WorkloadConfig(num_requests=12, isl=LengthDist.parse("5")), seed=0)
    closed = FakeClient(delay_s=0.01)
    asyncio.run(runner.run_point(closed, work, "concurrency", 3))
    assert closed.max_inflight == 3
    opened = FakeClient(delay_s=0.0)
    rate = 200.0
    records = asyncio.run(runner.run_point(opened, work, "rate", rate))
    for r, at in zip(records, work.arrivals):
        assert r.start >= at / rate - 1e-3
    capped = FakeClient(delay_s=0.02)
    asyncio.run(runner.run_point(capped, work, "rate", float("inf"), max_concurrency=2))
    assert capped.max_inflight == 2


def test_over_context_counts_what_a_servers_context_will_refuse():
    cfg = WorkloadConfig(kind="agentic", num_sessions=3, turns=LengthDist("fixed", 3), isl=LengthDist("fixed", 100),
                         tool_len=LengthDist("fixed", 10), osl=LengthDist("fixed", 20))
    work = wl.build(cfg, 0)
    # turns need 120, 150 and 180 tokens of context
    assert [wl.over_context(work, n) for n in (None, 0, 200, 180, 179, 150, 119)] == [0, 0, 0, 0, 3, 3, 9]


def test_a_priority_mix_puts_its_share_of_sessions_high_and_changes_nothing_else():
    cfg = WorkloadConfig(num_requests=50)
    mixed_cfg = WorkloadConfig(num_requests=50, priority_mix=0.2, high_priority=-3)
    plain, mixed = wl.build(cfg, seed=4), wl.build(mixed_cfg, seed=4)
    assert _stream(plain) == _stream(mixed)
    assert {s.priority for s in plain.sessions} == {None}
    assert [s.priority for s in mixed.sessions].count(-3) == 10
    assert {s.priority for s in mixed.sessions} == {-3, 0}
    assert [s.priority for s in wl.build(mixed_cfg, seed=4, salt=1).sessions] == [s.priority for s in mixed.sessions]
    assert [s.priority for s in wl.build(mixed_cfg, seed=5).sessions] != [s.priority for s in mixed.sessions]
    for bad in ({"priority_mix": 1.5}, {"priority_mix": -0.1}, {"priority_mix": 0.5, "high_priority": 0}):
        with pytest.raises(ValueError, match="priority"):
            WorkloadConfig(**bad)


def test_a_point_runs_without_full_collections_and_the_collector_comes_back_after():
    import gc

    before = gc.get_threshold()
    full = []
    cb = lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1)  # noqa: E731
    gc.callbacks.append(cb)
    try:
        with runner.no_full_collections():
            full.clear()
            junk = [[object()] for _ in range(200_000)]  # enough young collections for several full ones
            del junk
            assert gc.get_threshold()[:2] == before[:2] and not full
    finally:
        gc.callbacks.remove(cb)
    assert gc.get_threshold() == before
