import msgpack
import pytest

from moemesh.shared.protocol.messages import (
    Heartbeat, KVLayout, KVReady, KVReadyItem, PrefillJob, ProtocolError, TokenBatch, TokenEnd, TokenLogprob,
    WireSampling, WorkerLoad, decode, encode,
)


def test_round_trip_keeps_every_field():
    job = PrefillJob("r1", [0, 5, 9], WireSampling(max_tokens=7, seed=3, stop_token_ids=[2]), "gw", "dec", 1.5)
    assert decode(encode(job), PrefillJob) == job
    ready = KVReady("pre", b"\x00\x01ucx", KVLayout(4, 16, 40, "float32", "fp"),
                    [KVReadyItem("r1", [1, 2], [3], WireSampling(), "gw", 9, 2, 4096, "00-ab-cd-01", [4, 5])])
    assert decode(encode(ready), KVReady) == ready
    batch = TokenBatch(["a", "b", "c"], [1, 2, 70000], [2, 0, 1],
                       [TokenEnd(1, "error", "boom"), TokenEnd(2, "stop", None, [TokenLogprob(5, -0.5, [5], [-0.5])])],
                       "w", 1.0)
    assert decode(encode(batch), TokenBatch) == batch
    one_each = TokenBatch(["a", "b"], [7, 8], worker_id="w")
    assert decode(encode(one_each), TokenBatch) == one_each
    notice = TokenBatch(["a"], [7], [1], worker_id="p", positions=[0], handoffs={"a": "d2"})
    assert decode(encode(notice), TokenBatch) == notice
    assert len(msgpack.unpackb(encode(one_each))) == 7  # no hand-offs: what a gateway before them reads


@pytest.mark.parametrize("raw,needle", [
    ([0.0, "w", ["a", "b"], b"\x01\x00\x00\x00", None, []], "2 rows but 1 token ids"),
    ([0.0, "w", ["a"], b"\x01\x00\x00", None, []], "int32 bytes"),
    ([0.0, "w", ["a"], b"\x01\x00\x00\x00", b"\x02\x00\x00\x00", []], "counts do not match"),
    ([0.0, "w", ["a"], b"\x01\x00\x00\x00", None, [[3, "stop", None, None]]], "end of row 3"),
    ([0.0, "w", [1], b"\x01\x00\x00\x00", None, []], "header"),
    ([0.0, "w"], "malformed"),
    ([0.0, "w", ["a"], b"\x01\x00\x00\x00", None, [], b"", {"a": 5}], "handoffs"),
    ([0.0, "w", ["a"], b"\x01\x00\x00\x00", None, [], b"", {}, 1], "9 fields"),
])
def test_a_malformed_token_batch_is_one_protocol_error(raw, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(msgpack.packb(raw), TokenBatch)


@pytest.mark.parametrize("payload,needle", [
    (b"\xc1", "not valid MessagePack"),
    (msgpack.packb([1, 2]), "PrefillJob: expected object, got array"),
    (msgpack.packb({"request_id": "r"}), "PrefillJob: object missing required field prompt_ids"),
    (msgpack.packb({"request_id": "r", "prompt_ids": [1, "x"], "sampling": {}, "gateway_id": "g",
                    "decode_id": "d"}), r"PrefillJob.prompt_ids\[1\]: expected int, got str"),
    (msgpack.packb({"request_id": "r", "prompt_ids": [1], "sampling": {"max_tokens": True}, "gateway_id": "g",
                    "decode_id": "d"}), "PrefillJob.sampling.max_tokens: expected int, got bool"),
    (msgpack.packb({"request_id": 5, "prompt_ids": [1], "sampling": {}, "gateway_id": "g", "decode_id": "d"}),
     "PrefillJob.request_id: expected str, got int"),
])
def test_bad_messages_name_the_field(payload, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(payload, PrefillJob)


def test_optional_and_nested_defaults():
    hb = decode(msgpack.packb({"worker_id": "w", "role": "decode", "model": "m", "load": {}}), Heartbeat)
    assert hb.load == WorkerLoad() and hb.address == b"" and not hb.draining
    with pytest.raises(ProtocolError, match="Heartbeat.load.num_running: expected int"):
        decode(msgpack.packb({"worker_id": "w", "role": "d", "model": "m", "load": {"num_running": 1.5}}), Heartbeat)


def test_wire_sampling_validates_through_sampling_params():
    from moemesh.shared.protocol.messages import SamplingParamError

    with pytest.raises(SamplingParamError):
        WireSampling(max_tokens=0).to_params()
    p = WireSampling(max_tokens=3, temperature=0.0, stop_token_ids=[9]).to_params()
    assert p.greedy and p.stop_token_ids == (9,)
    with pytest.raises(SamplingParamError, match="prompt_logprobs"):
        WireSampling(prompt_logprobs=21).to_params()
    assert WireSampling.from_params(WireSampling(prompt_logprobs=3).to_params()).prompt_logprobs == 3


def test_msgspec_writes_the_bytes_the_field_walk_wrote():
    # the swap to msgspec kept the wire format: a map per message, fields by name, in order
    import dataclasses

    from moemesh.shared.protocol.messages import Heartbeat, PrefillJob, SamplingParams, WireSampling, WorkerLoad

    def walk(v):
        if dataclasses.is_dataclass(v):
            return {f.name: walk(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    job = PrefillJob("r", list(range(300)), WireSampling.from_params(SamplingParams(max_tokens=9, seed=3)), "g", "d")
    beat = Heartbeat("decode-0", "decode", "tiny", WorkerLoad(3, 1, 90, 128, 700, 12))
    for msg in (job, beat):
        assert encode(msg) == msgpack.packb(walk(msg), use_bin_type=True)
        assert decode(encode(msg), type(msg)) == msg


def test_priority_travels_with_the_sampling_and_an_old_sender_means_the_default():
    from moemesh.shared.protocol.messages import PRIORITY_MAX, PRIORITY_MIN, SamplingParamError, SamplingParams

    job = PrefillJob("r", [1, 2], WireSampling.from_params(SamplingParams(priority=-3)), "g", "d")
    assert decode(encode(job), PrefillJob).sampling.to_params().priority == -3
    old = msgpack.packb({"request_id": "r", "prompt_ids": [1], "sampling": {"max_tokens": 2}, "gateway_id": "g",
                         "decode_id": "d"})
    assert decode(old, PrefillJob).sampling.to_params().priority == 0
    assert WireSampling(priority=PRIORITY_MIN).to_params().priority == PRIORITY_MIN
    for bad in (PRIORITY_MIN - 1, PRIORITY_MAX + 1):
        with pytest.raises(SamplingParamError, match="priority"):
            WireSampling(priority=bad).to_params()
    with pytest.raises(ProtocolError, match="sampling.priority: expected int"):
        decode(msgpack.packb({"request_id": "r", "prompt_ids": [1], "sampling": {"priority": "high"},
                              "gateway_id": "g", "decode_id": "d"}), PrefillJob)
