from moemesh.services.gateway.routing.router import KVIndex, pick_prefill, route_prefill
from moemesh.shared.protocol.messages import Heartbeat, KVEvents, WorkerLoad
from moemesh.shared.protocol.prefix_hash import chain


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


def _holder(wid, role, ident=b"i", bs=4, pending=0):
    return Heartbeat(wid, role, "m", WorkerLoad(pending_prompt_tokens=pending), kv_identity=ident, block_size=bs)


def test_route_prefill_picks_the_worker_and_longer_holders_to_pull_from():
    prompt = list(range(21))  # 5 usable blocks of 4: the last token is always computed
    hashes = chain(prompt, 4, b"i", 5)
    ix = KVIndex()
    ix.apply(KVEvents("p1", "prefill", b"i", hashes[:1]))
    ix.apply(KVEvents("p2", "prefill", b"i", hashes[:2]))
    ix.apply(KVEvents("d1", "decode", b"i", hashes[:4]))
    ix.apply(KVEvents("store", "kv_store", b"", hashes))
    ix.apply(KVEvents("other", "decode", b"j", hashes))  # another model: its blocks mean nothing here
    p1, p2 = _holder("p1", "prefill"), _holder("p2", "prefill", pending=2)
    peers = [p1, p2, _holder("d1", "decode"), _holder("store", "kv_store", ident=b"s"),
             _holder("other", "decode", ident=b"j"), _holder("unknown", "decode")]
    chosen, sources = route_prefill(prompt, [p1, p2], peers, ix, {})
    assert chosen.worker_id == "p2"  # 8 cached tokens minus 2 queued beat 4 cached
    assert [(s.holder_id, s.num_blocks) for s in sources] == [("store", 5), ("d1", 4)]
    chosen, _ = route_prefill(prompt, [p1, p2], peers, ix, {"p2": 10})
    assert chosen.worker_id == "p1"  # what this gateway just sent p2 counts as queued
    assert route_prefill(prompt, [], peers, ix, {}) == (None, [])
    assert route_prefill(prompt, [p1], [p1], KVIndex(), {}) == (p1, [])  # nothing known of anyone


def test_among_holders_as_deep_the_store_is_asked_first():
    prompt = list(range(21))
    hashes = chain(prompt, 4, b"i", 5)
    ix = KVIndex()
    ix.apply(KVEvents("d1", "decode", b"i", hashes))
    ix.apply(KVEvents("store", "kv_store", b"", hashes))
    ix.apply(KVEvents("d2", "decode", b"i", hashes[:3]))
    p1 = _holder("p1", "prefill")
    peers = [p1, _holder("d2", "decode"), _holder("d1", "decode"), _holder("store", "kv_store", ident=b"s")]
    _, sources = route_prefill(prompt, [p1], peers, ix, {})
    assert [(s.holder_id, s.num_blocks) for s in sources] == [("store", 5), ("d1", 5)]


def test_a_holder_that_failed_a_fetch_is_passed_over_for_a_while():
    from moemesh.shared.service.kv_sharing import PassedOver

    p = PassedOver(10.0)
    assert not p.now("store", 0.0)
    assert p.note("store", 100.0)  # the first failure: worth a log line
    assert p.now("store", 105.0) and not p.now("decode-1", 105.0)
    assert not p.note("store", 103.0)  # already passed over; the window runs from the latest failure
    assert p.now("store", 112.0) and not p.now("store", 113.5)
