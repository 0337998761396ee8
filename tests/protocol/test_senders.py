"""A message's claimed sender against the subject it came on."""

from moemesh.shared.protocol.messages import (
    Heartbeat, KVEvents, StatsRequest, TokenBatch, WorkerLoad, sender_matches,
)
from moemesh.shared.protocol.subjects import Subjects


def test_a_body_must_name_the_sender_its_subject_names():
    s = Subjects("a.b")  # a prefix with dots: the check reads from the subject's end
    hb = Heartbeat("decode-1", "decode", "m", WorkerLoad())
    assert sender_matches(hb, s.heartbeat("decode", "decode-1"))
    assert not sender_matches(hb, s.heartbeat("decode", "decode-0"))
    assert not sender_matches(hb, s.heartbeat("prefill", "decode-1"))
    batch = TokenBatch(["r"], [1], worker_id="decode-1")
    assert sender_matches(batch, s.gateway_tokens("gw", "decode-1"))
    assert not sender_matches(batch, s.gateway_tokens("gw", "decode-0"))
    assert not sender_matches(TokenBatch(["r"], [1]), s.gateway_tokens("gw", "decode-1"))
    ev = KVEvents("kv_store", "kv_store", b"*")
    assert sender_matches(ev, s.kv_events("kv_store")) and not sender_matches(ev, s.kv_events("prefill-0"))
    assert sender_matches(StatsRequest(), s.stats("x"))  # names no sender: nothing to check
