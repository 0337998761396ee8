import msgpack
import pytest

from moemesh.shared.protocol.messages import (
    PromptLogprobs, ProtocolError, TokenBatch, TokenEnd, TokenLogprob, decode, encode, ids_from_wire, ids_to_wire,
)
from moemesh.shared.protocol.prefix_hash import chain, kv_identity


def test_block_hashes_are_pinned():
    # The prefix cache, the KV store and the gateway's KV-aware routing all compare these
    # keys across processes and versions: a change here must be deliberate.
    ident = kv_identity({"model_type": "deepseek_v3", "hidden": 64}, 16, "bfloat16")
    assert ident.hex() == "e01f81bfa3d63f2890c9e667402b3f97"
    assert [h.hex() for h in chain(list(range(40)), 16, ident)] == [
        "35960897b8fef801eff20d2fe50039e3", "156906392a2f78837d496bffa84ee551"]


def test_ids_round_trip_as_int32():
    ids = [0, 1, 70000, 2**31 - 1]
    assert ids_from_wire(ids_to_wire(ids), "x") == ids
    with pytest.raises(TypeError, match="int32 bytes"):
        ids_from_wire(b"\x00" * 5, "x")


def _batch_with(lps) -> bytes:
    return msgpack.packb([0.0, "w", ["a"], ids_to_wire([5]), None, [[0, "stop", None, lps]]])


def test_logprobs_travel_with_int_ids():
    lp = TokenLogprob(5, -0.25, [5, 9], [-0.25, -2.0])
    got = decode(encode(TokenBatch(["a"], [5], None, [TokenEnd(0, "stop", None, [lp])])), TokenBatch)
    (back,) = got.ends[0].logprobs
    assert back == lp and type(back.token_id) is int and all(type(t) is int for t in back.top_ids)
    # an integral logprob (msgpack may send 0 as an int) is still a float
    assert decode(_batch_with([[5, 0, [], []]]), TokenBatch).ends[0].logprobs[0].logprob == 0.0


@pytest.mark.parametrize("lps,needle", [
    ([[5.0, -0.5, [], []]], "logprob of token 5.0"),  # an id as a float is refused, not truncated
    ([[5, -0.5, [1.0], [-0.5]]], "logprob of token 5"),
    ([[5, "x", [], []]], "logprob of token 5"),
    ([[5, -0.5, [1, 2], [-0.5]]], "2 top ids but 1 logprobs"),
    ([[5, -0.5]], "malformed"),
    ({"a": 1}, "expected a list"),
])
def test_a_malformed_logprob_is_one_protocol_error(lps, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(_batch_with(lps), TokenBatch)


def test_a_first_tokens_cached_count_travels_and_older_ends_still_decode():
    got = decode(encode(TokenBatch(["a"], [5], None, [TokenEnd(0, None, None, None, 48)], positions=[0])),
                 TokenBatch)
    assert got.ends[0].cached_tokens == 48
    assert decode(_batch_with(None), TokenBatch).ends[0].cached_tokens is None  # a build without the field
    for bad in (-1, 1.0, "3", 2**40):
        with pytest.raises(ProtocolError, match="end of row"):
            decode(msgpack.packb([0.0, "w", ["a"], ids_to_wire([5]), None, [[0, None, None, None, bad]]]),
                   TokenBatch)


def test_prompt_logprobs_travel_with_the_first_token_by_column():
    p = PromptLogprobs(2, [-0.5, -7.25], [1, 300], [9, 4, 3, 9], [-0.5, -1.5, -0.125, -2.0])
    end = TokenEnd(0, None, None, None, None, p)  # no cached count: it still travels
    got = decode(encode(TokenBatch(["a"], [5], None, [end], positions=[0])), TokenBatch).ends[0]
    assert got.prompt_logprobs == p and got.cached_tokens is None
    assert got.prompt_logprobs.top(1) == ([3, 9], [-0.125, -2.0])
    one = PromptLogprobs.empty(1, 3)  # a one-token prompt scores nothing
    assert one.num_rows == 0 and decode(encode(TokenBatch(["a"], [5], None, [TokenEnd(0, None, None, None, 0, one)])),
                                    TokenBatch).ends[0].prompt_logprobs == one


@pytest.mark.parametrize("plain,needle", [
    ([1, b"\x00" * 4, ids_to_wire([1]), ids_to_wire([]), b""], "columns do not match 1 rows of 1"),
    ([0, b"\x00" * 4, ids_to_wire([0]), b"", b""], "rank below 1"),
    ([1, b"\x00" * 4, ids_to_wire([1]), ids_to_wire([-3]), b"\x00" * 4], "negative token id"),
    ([0, b"\x00" * 3, b"", b"", b""], "float32 bytes"),
    ([1.0, b"", b"", b"", b""], "num_top"),
    ([0, b"", b""], "expected \\[num_top"),
])
def test_malformed_prompt_logprobs_are_one_protocol_error(plain, needle):
    raw = msgpack.packb([0.0, "w", ["a"], ids_to_wire([5]), None, [[0, None, None, None, None, plain]]])
    with pytest.raises(ProtocolError, match=needle):
        decode(raw, TokenBatch)
