"""Report files from a synthetic result: strict JSON, Markdown and PNGs, with a rate of inf."""

from __future__ import annotations

import json

from moemesh.tools.bench.serve import report
from moemesh.tools.bench.serve.metrics import RequestRecord, summarize


def _point(value: float, scale: float) -> dict:
    recs = [RequestRecord(index=i, session=i, turn=1, max_tokens=4, target_input_tokens=8, start=0.1 * i,
                          end=0.1 * i + 0.4 * scale, chunk_times=[0.1 * i + k * 0.1 * scale for k in (1, 2, 3, 4)],
                          chunk_tokens=[1, 1, 1, 1], output_tokens=4) for i in range(5)]
    return {"mode": "rate", "value": value, "text_salt": 0, "summary": summarize(recs, slo_ttft_ms=150),
            "requests": [r.to_json() for r in recs]}


def test_write_all_with_an_inf_rate(tmp_path):
    wl = {"kind": "random", "isl": "8", "osl": "4", "num_requests": 5, "num_sessions": 1, "turns": "1",
          "tool_len": "1", "num_prefix_groups": 1, "prefix_len": 1}
    result = {"bench": "serve", "config": {"url": "http://x", "endpoint": "chat", "model": "m", "workload": wl,
                                           "mode": "rate", "values": [2.0, float("inf")], "max_concurrency": 4,
                                           "seed": 0, "ignore_eos": True, "tokenizer": None, "labels": {"skew": "z"},
                                           "slo_ttft_ms": 150, "slo_tpot_ms": None},
              "warmup": {"num_requests": 0, "num_errors": 0}, "points": [_point(2.0, 1.0), _point(float("inf"), 2.0)]}
    paths = report.write_all(result, tmp_path / "out")
    assert sorted(p.name for p in paths) == ["latency_cdf.png", "result.json", "summary.md", "throughput.png"]
    def no_constants(token):
        raise AssertionError(f"non-standard JSON constant {token}")

    data = json.loads((tmp_path / "out" / "result.json").read_text(), parse_constant=no_constants)
    assert data["config"]["values"] == [2.0, "inf"] and data["points"][1]["value"] == "inf"
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "rate=inf" in md and "skew=z" in md and "![throughput.png](throughput.png)" in md
    # the faster point has TTFT 100 ms and meets the 150 ms SLO; the slower one (200 ms) does not
    assert result["points"][0]["summary"]["goodput"]["share"] == 1.0
    assert result["points"][1]["summary"]["goodput"]["share"] == 0.0
