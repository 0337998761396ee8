"""Serving metrics on synthetic timestamps with answers worked out by hand, and SSE parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moemesh.tools.bench.serve import metrics as m
from moemesh.tools.bench.serve.client import DONE, event_content, event_error, parse_event


def rec(index=0, start=0.0, chunks=(), tokens=None, end=None, out=None, turn=1, **kw) -> m.RequestRecord:
    tokens = list(tokens) if tokens is not None else [1] * len(chunks)
    return m.RequestRecord(index=index, session=index, turn=turn, max_tokens=16, target_input_tokens=10,
                           start=start, end=end if end is not None else (chunks[-1] if chunks else start),
                           chunk_times=list(chunks), chunk_tokens=tokens,
                           output_tokens=sum(tokens) if out is None else out, **kw)


def test_one_request_known_answers():
    # chunks at 0.1, 0.2, 0.4 s carrying 1, 1, 2 tokens; the 0.2 s gap is two 0.1 s token gaps
    r = rec(chunks=[0.1, 0.2, 0.4], tokens=[1, 1, 2], end=0.4)
    assert m.ttft(r) == pytest.approx(0.1)
    assert m.e2e(r) == pytest.approx(0.4)
    assert m.tpot(r) == pytest.approx(0.1)  # (0.4 - 0.1) / (4 - 1)
    assert m.itl(r) == pytest.approx([0.1, 0.1, 0.1])
    assert m.tps_user(r) == pytest.approx(10.0)  # 4 tokens / 0.4 s


def test_one_token_answer_has_no_tpot_and_cannot_miss_it():
    r = rec(chunks=[0.05], end=0.05)
    assert m.tpot(r) is None
    assert m.itl(r) == []
    assert m.meets_slo(r, slo_ttft_ms=100, slo_tpot_ms=1)
    assert not m.meets_slo(r, slo_ttft_ms=10, slo_tpot_ms=None)


def test_summary_known_answers():
    records = [
        rec(0, 0.0, [0.1, 0.2, 0.4], [1, 1, 2], end=0.4, worker="w0"),
        rec(1, 0.5, [0.7, 0.8], [1, 1], end=1.0, worker="w1"),
        rec(2, 0.2, [], end=0.3, status=500, error="HTTP 500: boom"),
        rec(3, 0.3, [], end=0.35, status=None, error="ConnectError: refused"),
    ]
    s = m.summarize(records, slo_ttft_ms=150, slo_tpot_ms=200)
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (4, 2, 2)
    assert s["duration_s"] == pytest.approx(1.0)
    assert s["output_tokens_per_s"] == pytest.approx(6.0)
    assert s["requests_per_s"] == pytest.approx(2.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(150) and s["ttft_ms"]["mean"] == pytest.approx(150)
    assert s["ttft_ms"]["p90"] == pytest.approx(190)
    assert s["tpot_ms"]["p50"] == pytest.approx(200)  # 100 and 300 ms
    assert s["e2e_ms"]["p99"] == pytest.approx(499)
    assert s["itl_ms"]["count"] == 4 and s["itl_ms"]["p99"] == pytest.approx(100)
    assert s["tps_per_user"]["p10"] == pytest.approx(4.6)  # users at 10 and 4 tok/s
    assert s["tps_per_user"]["p90"] == pytest.approx(9.4) == s["headline_p90_tps_per_user"]
    assert s["decode_tps_per_user"]["p90"] == pytest.approx(1 / 0.3 + 0.9 * (10 - 1 / 0.3))
    assert s["per_worker_output_tokens_per_s"] == pytest.approx({"w0": 4.0, "w1": 2.0})
    # only the first meets TTFT <= 150 ms and TPOT <= 200 ms
    assert s["goodput"]["num_good"] == 1
    assert s["goodput"]["requests_per_s"] == pytest.approx(1.0)
    assert s["goodput"]["share"] == pytest.approx(0.25)
    assert s["errors"]["by_status"] == {"500": 1, "no_response": 1}
    assert "ttft_ms_by_turn" not in s


def test_summary_without_workers_slo_or_records():
    s = m.summarize([rec(0, 0.0, [0.1, 0.2], end=0.2)])
    assert "per_worker_output_tokens_per_s" not in s
    assert s["goodput"] is None
    empty = m.summarize([])
    assert empty["num_requests"] == 0 and empty["requests_per_s"] is None
    assert empty["ttft_ms"]["p50"] is None


def test_ttft_by_turn():
    s = m.summarize([rec(0, 0.0, [0.5, 0.6], turn=1), rec(1, 1.0, [1.1, 1.2], turn=2),
                     rec(2, 2.0, [2.3, 2.4], turn=3)])
    assert s["ttft_ms_by_turn"]["1"]["p50"] == pytest.approx(500)
    assert s["ttft_ms_by_turn"]["2+"]["p50"] == pytest.approx(200)


def test_stream_error_is_its_own_kind():
    s = m.summarize([rec(0, 0.0, [0.1], status=200, error="stream error: x")])
    assert s["errors"]["by_status"] == {"stream_error": 1}


@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(1, 4)), min_size=1, max_size=30))
def test_itl_covers_the_stream(chunks):
    times, t = [], 0.0
    for gap, _ in chunks:
        t += gap
        times.append(t)
    tokens = [k for _, k in chunks]
    r = rec(chunks=times, tokens=tokens)
    gaps = m.itl(r)
    assert len(gaps) == sum(tokens[1:])
    assert sum(gaps) == pytest.approx(times[-1] - times[0], abs=1e-9)


def test_parse_event_data():
    assert parse_event("[DONE]") == DONE
    assert parse_event('{"a": 1}') == {"a": 1}
    assert "unparseable" in event_error(parse_event("{oops"))
    assert "unexpected" in event_error(parse_event("[1]"))


def test_event_errors_and_content():
    assert event_error({"error": {"message": "too long", "code": 400}}) == "too long"
    assert event_error({"object": "error", "message": "vllm says no"}) == "vllm says no"
    assert event_error({"choices": []}) is None
    chat = {"choices": [{"delta": {"reasoning_content": "hm ", "content": "hi"}, "finish_reason": None}]}
    assert event_content(chat, "chat") == ("hm hi", "hi", None)
    comp = {"choices": [{"text": "x", "finish_reason": "length"}]}
    assert event_content(comp, "completions") == ("x", "x", "length")
    assert event_content({"choices": [], "usage": {}}, "chat") == ("", "", None)


def test_by_priority_known_answers():
    records = [
        rec(0, 0.0, [0.1, 0.2], end=0.2, priority=-1),
        rec(1, 0.0, [0.3, 0.5], end=0.5, priority=0),
        rec(2, 0.0, [], end=0.01, priority=0, status=429, error="HTTP 429: at capacity"),
        rec(3, 0.0, [], end=0.01, priority=0, status=500, error="HTTP 500: boom"),
        rec(4, 0.0, [0.05], end=0.05, priority=-1),
    ]
    s = m.summarize(records)
    by = s["by_priority"]
    assert list(by) == ["-1", "0"]
    hi, lo = by["-1"], by["0"]
    assert (hi["num_requests"], hi["num_ok"], hi["num_429"], hi["num_errors"]) == (2, 2, 0, 0)
    assert (lo["num_requests"], lo["num_ok"], lo["num_429"], lo["num_errors"]) == (3, 1, 1, 2)
    assert hi["ttft_ms"]["p50"] == pytest.approx(75) and hi["itl_ms"]["count"] == 1
    assert lo["ttft_ms"]["p99"] == pytest.approx(300) and lo["e2e_ms"]["p50"] == pytest.approx(500)
    assert "by_priority" not in m.summarize([rec(0, 0.0, [0.1])])  # no mix, no classes
