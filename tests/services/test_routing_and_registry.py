import pytest

from moemesh.services.gateway.routing.router import pick_decode
from moemesh.shared.protocol.messages import Heartbeat, WorkerLoad
from moemesh.shared.protocol.registry import WorkerRegistry


def _hb(wid, out, free=100, role="decode", interval=1.0, draining=False):
    return Heartbeat(wid, role, "m", WorkerLoad(outstanding_tokens=out, num_free_blocks=free), interval_s=interval,
                     draining=draining)


def test_least_outstanding_tokens_wins_counting_what_was_just_sent():
    ws = [_hb("a", 100), _hb("b", 50), _hb("c", 50, free=10)]
    assert pick_decode(ws, {}).worker_id == "b"  # tie on load: more free blocks wins
    assert pick_decode(ws, {"b": 80}).worker_id == "c"
    assert pick_decode(ws, {"b": 80, "c": 80}).worker_id == "a"
    assert pick_decode([], {}) is None


def test_a_worker_whose_handoffs_fail_is_chosen_only_when_no_other_is_left():
    cut = Heartbeat("a", "decode", "m", WorkerLoad(outstanding_tokens=0, num_free_blocks=100), handoffs_failing=True)
    assert pick_decode([cut, _hb("b", 500)], {}).worker_id == "b"  # busier, but its data plane works
    assert pick_decode([cut], {}).worker_id == "a"  # still served: a recompute beats a refusal


def test_registry_forgets_silent_and_draining_workers():
    r = WorkerRegistry(miss_factor=3, min_timeout_s=2)
    r.observe(_hb("a", 0), now=0.0)
    r.observe(_hb("b", 0, interval=0.5), now=0.0)
    r.observe(_hb("p", 0, role="prefill"), now=0.0)
    assert set(r.workers) == {"a", "b", "p"}
    assert r.prune(now=2.5) == ["b"]  # 0.5 s beats: gone after max(2, 1.5) s
    assert sorted(r.prune(now=3.5)) == ["a", "p"]
    r.observe(_hb("a", 0), now=4.0)
    r.observe(_hb("a", 0, draining=True), now=4.1)
    assert "a" not in r.workers


def _ids(hbs):
    return [hb.worker_id for hb in hbs]


def test_a_suspect_gets_no_new_work_at_once_but_only_a_confirmed_death_kills_it_sooner():
    r = WorkerRegistry(miss_factor=2, min_timeout_s=1.0)
    for w in ("a", "b"):
        r.observe(_hb(w, 0), now=0.0)
    assert r.suspect("a", now=0.1)
    assert not r.suspect("a", now=0.2) and not r.suspect("nobody", now=0.2)  # once; only the known
    assert _ids(r.live("decode", now=0.2)) == ["b"]
    r.observe(_hb("a", 0), now=0.15)  # a beat already on its way when it was found gone
    assert r.is_suspect("a") and _ids(r.live("decode", now=0.2)) == ["b"]
    # Silent for one interval: a suspect is to be asked about, an unsuspected worker not yet.
    assert r.silent(2.0, 1.0, now=1.2) == ["a"] and r.silent(2.0, 1.0, now=2.1) == ["a", "b"]
    assert r.prune(now=1.7) == []  # suspect and silent, yet maybe only slow
    assert r.confirm_gone("a") and not r.confirm_gone("a") and not r.confirm_gone("nobody")
    assert r.silent(2.0, 1.0, now=1.8) == []  # known gone: nothing left to ask
    assert r.prune(now=1.8) == ["a"]
    assert r.prune(now=1.9) == [] and _ids(r.live("decode", now=1.9)) == ["b"]

    r.observe(_hb("c", 0), now=3.0)
    r.suspect("c", now=3.1)
    r.observe(_hb("c", 0), now=3.7)  # sent after it was found gone: it is back
    assert not r.is_suspect("c") and "c" in _ids(r.live("decode", now=3.7))
    r.hold()  # our own link is down: a failed request says nothing about the worker
    assert not r.suspect("c", now=3.8) and not r.is_suspect("c")
    assert not r.confirm_gone("c") and r.silent(0.0, 0.0, now=9.0) == []


def test_live_leaves_the_silent_out_but_only_prune_forgets_them_when_the_owner_prunes():
    """The gateway moves a dead worker's requests when prune() reports it: a routing call
    in between must not forget the worker first, or its requests would never move."""
    r = WorkerRegistry(miss_factor=2, min_timeout_s=1.0, owner_prunes=True)
    r.observe(_hb("a", 0), now=0.0)
    r.observe(_hb("b", 0), now=4.5)
    assert _ids(r.live("decode", now=5.0)) == ["b"]
    assert _ids(r.live(None, now=5.0)) == ["b"]
    assert r.prune(now=5.0) == ["a"]


def test_a_paused_owner_judges_nobody_by_the_beats_it_could_not_read():
    r = WorkerRegistry(miss_factor=2, min_timeout_s=1.0)
    r.observe(_hb("a", 0), now=0.0)
    assert r.tick(1.0, now=0.25) == 0.0 and r.tick(1.0, now=0.5) == 0.0
    assert r.tick(1.0, now=3.5) == 3.0  # stopped for 3 s: "a" beat all along, unread
    assert r.prune(now=3.6) == [] and _ids(r.live("decode", now=3.6)) == ["a"]
    assert r.tick(1.0, now=3.75) == 0.0
    assert r.prune(now=5.6) == ["a"]  # silent since, while we ran: dead


def test_nothing_subscribed_counts_from_the_first_probe_and_a_beat_clears_it():
    """A worker whose NATS node died has no subscriptions until it reaches another node:
    the gateway times how long a silent worker stays unsubscribed before it is gone."""
    r = WorkerRegistry(miss_factor=6.0, min_timeout_s=1.0, owner_prunes=True)
    r.observe(_hb("a", 0), now=0.0)
    assert r.unsubscribed("a", now=0.5) == 0.0 and r.unsubscribed("a", now=1.2) == pytest.approx(0.7)
    assert r.unsubscribed("nobody", now=1.2) is None
    r.observe(_hb("a", 0), now=1.3)  # it resubscribed elsewhere and beat again
    assert r.unsubscribed("a", now=2.0) == 0.0 and r.prune(now=2.0) == []
