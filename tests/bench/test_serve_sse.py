"""`bench serve` reads server-sent events as the standard defines them."""

from __future__ import annotations

import random

from moemesh.tools.bench.serve.sse import SSEParser

PAYLOAD = '{"t":"a\u2028b\u0085c\u2029d\x1ce"}'  # separators a text decoder would split lines at


def _all(chunks: list[bytes]) -> list[str]:
    p = SSEParser()
    return [d for c in chunks for d in p.feed(c)]


def test_lines_end_only_at_cr_lf_or_crlf():
    for end in ("\n", "\r\n", "\r"):
        body = f"data: {PAYLOAD}{end}{end}: comment{end}data:x{end}{end}".encode()
        assert _all([body]) == [PAYLOAD, "x"], repr(end)


def test_any_split_gives_the_same_events():
    body = ("\ufeffdata: one\r\n\r\nevent: ping\ndata: two\ndata:  three\n\nid: 7\n\n"
            f"data: {PAYLOAD}\r\rdata: [DONE]\n\n").encode()
    want = ["one", "two\n three", PAYLOAD, "[DONE]"]  # a data line loses one space only; no-data events vanish
    rng = random.Random(3)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randrange(0, 12)))
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
        assert _all(parts) == want
    assert _all([bytes([b]) for b in body]) == want  # a byte at a time, CRLF split included


def test_an_unterminated_last_event_is_not_dispatched():
    p = SSEParser()
    assert p.feed(b"data: whole\n\ndata: cut off") == ["whole"]
    assert p.close() == []
