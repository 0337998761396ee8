"""What a worker sends again when a gateway lost token batches: each request's ids from
the position asked for, with its end; an error when that part is no longer kept."""

from __future__ import annotations

import asyncio

from moemesh.shared.protocol.messages import PromptLogprobs, TokenResend
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.runtime import LOST, TokenPublisher


SCORES = PromptLogprobs(0, [-1.5, -0.25], [4, 1])


class _Sink:
    def __init__(self):
        self.sent = []

    async def publish(self, subject, data):
        self.sent.append(subject)


def _publisher(retention_s=30.0):
    return TokenPublisher(_Sink(), Subjects(), "w1", retention_s)


def test_replay_puts_a_stream_back_together_from_a_position():
    async def go():
        p = _publisher()
        p.add("gw", "a", [5], position=0, cached_tokens=32, prompt_logprobs=SCORES)
        p.add("gw", "b", [50, 51], position=0)
        await p.flush()
        p.add("gw", "a", [6, 7], position=1)
        await p.flush()
        p.add("gw", "a", [8], "length", position=3)
        p.add("gw", "b", [52], position=2)
        await p.flush()
        return p

    p = asyncio.run(go())
    got = dict(p.replay(TokenResend("gw", ["a", "b", "unknown"], [2, 0, 0])))
    # the first token's cached count goes along; its prompt's scores only with the first token itself
    assert got["a"] == ([7, 8], "length", None, None, 2, 32, None)
    assert got["b"] == ([50, 51, 52], None, None, None, 0, None, None)
    assert dict(p.replay(TokenResend("gw", ["a"], [0])))["a"] == ([5, 6, 7, 8], "length", None, None, 0, 32, SCORES)
    assert "unknown" not in got  # another worker serves it
    assert dict(p.replay(TokenResend("other-gw", ["a"], [0]))) == {}


def test_a_part_no_longer_kept_ends_the_stream_with_an_error():
    async def go():
        p = _publisher(retention_s=0.0)
        p.add("gw", "a", [5], position=0)
        await p.flush()
        await asyncio.sleep(0.01)
        p.add("gw", "a", [6], position=1)  # flushing this one drops the first
        await p.flush()
        return p

    p = asyncio.run(go())
    (rid, (ids, finish, error, _, _)), = p.replay(TokenResend("gw", ["a"], [0]))
    assert (rid, ids, finish, error) == ("a", [], "error", LOST) and p.lost_rows == 1
    assert dict(p.replay(TokenResend("gw", ["a"], [1])))["a"][0] == [6]


def test_a_part_another_worker_made_is_not_called_lost():
    """A decode worker's rows begin after the prefill worker's first token. A gateway that
    missed that token asks both workers from position 0: the prefill worker sends it, and
    the decode worker must not end the stream as lost for a part that was never its own."""
    async def go():
        p = _publisher()
        p.add("gw", "older", [9], position=4)
        await p.flush()
        p.add("gw", "a", [6], position=1)  # the prefill worker made position 0
        await p.flush()
        p.add("gw", "a", [7], position=2)
        await p.flush()
        return p

    p = asyncio.run(go())
    assert dict(p.replay(TokenResend("gw", ["a"], [0]))) == {} and p.lost_rows == 0
    assert dict(p.replay(TokenResend("gw", ["a"], [1])))["a"][0] == [6, 7]
