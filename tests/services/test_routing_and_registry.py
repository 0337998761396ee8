import time

from moemesh.services.gateway.router import pick_decode
from moemesh.shared.protocol.messages import Heartbeat, WorkerLoad
from moemesh.shared.service.heartbeat import WorkerRegistry


def _hb(wid, out, free=100, role="decode", interval=1.0, draining=False):
    return Heartbeat(wid, role, "m", WorkerLoad(outstanding_tokens=out, num_free_blocks=free), interval_s=interval,
                     draining=draining)


def test_least_outstanding_tokens_wins_counting_what_was_just_sent():
    ws = [_hb("a", 100), _hb("b", 50), _hb("c", 50, free=10)]
    assert pick_decode(ws, {}).worker_id == "b"  # tie on load: more free blocks wins
    assert pick_decode(ws, {"b": 80}).worker_id == "c"
    assert pick_decode(ws, {"b": 80, "c": 80}).worker_id == "a"
    assert pick_decode([], {}) is None


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


def test_a_silent_worker_left_out_of_live_is_still_named_dead_by_prune():
    # The gateway moves a dead worker's streams when prune() names it. A request (or a
    # /health call) that asks for live workers first must not forget the worker on the
    # way, or its streams never move and stall until the inactivity timeout.
    r = WorkerRegistry(miss_factor=2, min_timeout_s=1)
    now = time.monotonic()
    r.observe(_hb("a", 0), now=now - 10)  # silent for 10 s: dead
    r.observe(_hb("b", 0), now=now)
    assert [hb.worker_id for hb in r.live("decode")] == ["b"]
    assert r.prune() == ["a"]
    assert r.prune() == []


def test_live_leaves_out_no_one_while_our_own_link_is_down():
    r = WorkerRegistry(miss_factor=2, min_timeout_s=1)
    r.observe(_hb("a", 0), now=time.monotonic() - 10)
    r.hold()
    assert [hb.worker_id for hb in r.live("decode")] == ["a"]
    r.resume()
    assert [hb.worker_id for hb in r.live("decode")] == ["a"]
