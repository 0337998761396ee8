from moemesh.services.gateway.kv_index import KVIndex
from moemesh.services.gateway.router import pick_prefill
from moemesh.shared.protocol.messages import Heartbeat, KVEvents, WorkerLoad


def _hb(wid, pending=0):
    return Heartbeat(wid, "prefill", "m", WorkerLoad(pending_prompt_tokens=pending), kv_identity=b"i", block_size=16)


def test_index_tracks_events_and_resets():
    ix = KVIndex()
    ix.apply(KVEvents("a", "prefill", b"i", [b"1", b"2", b"3"]))
    ix.apply(KVEvents("a", "prefill", b"i", [], [b"2"]))
    assert ix.overlap("a", [b"1", b"2", b"3"]) == 1  # a chain stops at the first gap
    ix.apply(KVEvents("a", "prefill", b"i", [b"9"], reset=True))
    assert ix.overlap("a", [b"1"]) == 0 and ix.overlap("a", [b"9"]) == 1
    ix.forget("a")
    assert not ix.knows("a")


def test_prefix_overlap_wins_unless_the_holder_is_far_busier():
    ws = [_hb("a", pending=100), _hb("b", pending=0)]
    assert pick_prefill(ws, {"a": 20}, 16, {}).worker_id == "a"  # 320 cached tokens beat 100 queued
    assert pick_prefill(ws, {"a": 5}, 16, {}).worker_id == "b"  # 80 cached do not
    assert pick_prefill(ws, {"a": 20}, 16, {"a": 300}).worker_id == "b"  # we just sent it a lot
    assert pick_prefill(ws, {}, 16, {}).worker_id == "b"  # no cache anywhere: least queued
