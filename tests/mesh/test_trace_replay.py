"""A Mooncake-format trace replayed through a real mesh of mock engines: the prefix reuse
the trace implies is what the mesh's prefix cache finds, at the trace's own lengths (past
the tiny model's 4,096 positions, which a mock engine may serve) and scaled down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mesh.conftest import start_mesh

ROOT = Path(__file__).resolve().parents[2]
LONG = 32768  # past the tiny model's 4,096 positions
MOCK = ["engine=mock", "mock_step_ms=2", "num_kv_blocks=8192", f"max_model_len={LONG}", "staging_mb=64"]


def conversations(path: Path, n: int = 5, turns: int = 4, blocks_a_turn: int = 8, gap_s: float = 2.0) -> Path:
    """n conversations whose every turn resends the one before and adds blocks_a_turn
    512-token blocks, turns gap_s apart (ample for the turn before to be prefilled, so the
    reuse the trace implies is there to find); conversations start 0.3 s apart."""
    rows, next_id = [], 0
    for c in range(n):
        ids: list[int] = []
        for k in range(turns):
            ids = ids + list(range(next_id, next_id + blocks_a_turn))
            next_id += blocks_a_turn
            rows.append({"timestamp": int((gap_s * k + 0.3 * c) * 1000), "input_length": len(ids) * 512 - 100,
                         "output_length": 8, "hash_ids": ids})
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def mock_mesh(tiny_model, tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("trace-mesh"), tiny_model, prefill_set=MOCK, decode_set=MOCK,
                   gateway_set=[f"max_model_len={LONG}", "allow_long_max_model_len=true"])
    yield m
    m.group.stop()


def replay(mesh, trace: Path, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "moemesh.tools.cli.main", "bench", "serve", "--url", mesh.url, "--workload", "trace",
           "--trace", str(trace), "--tokenizer", mesh.model, "--out-dir", str(out), "--no-progress", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "prefix hit rate: trace implies" in p.stdout
    return json.loads((out / "result.json").read_text())


def test_a_trace_replays_with_the_reuse_it_implies(mock_mesh, tmp_path):
    trace = conversations(tmp_path / "conv.jsonl")
    r = replay(mock_mesh, trace, tmp_path / "full")
    assert r["config"]["server_max_model_len"] == LONG
    (p,) = r["points"]
    assert p["mode"] == "trace" and p["summary"]["num_ok"] == 20, p["summary"]["errors"]
    t = p["trace"]
    assert t["scale"] == 1 and t["block_tokens"] == 512 and t["longest_context"] == 32 * 512 - 100 + 8
    assert [q["input_tokens"] for q in p["requests"]][:5] == [8 * 512 - 100] * 5
    # 3 of each conversation's 4 turns find the turns before them cached: 60% of the tokens.
    assert t["implied_hit_rate"] == pytest.approx((8 + 16 + 24) * 512 / sum(k * 512 - 100 for k in (8, 16, 24, 32)),
                                                  abs=1e-3)
    assert abs(t["achieved"]["hit_rate"] - t["implied_hit_rate"]) <= 0.05, t
    assert t["achieved"]["requests_reporting_cached"] == 20
    assert {k: b["count"] for k, b in t["by_band"].items()} == {"<4k": 5, "4k-16k": 15}  # 3,996 tokens; 8k-16k


def test_a_trace_past_the_context_is_scaled_to_fit_and_keeps_its_reuse(mock_mesh, tmp_path):
    trace = conversations(tmp_path / "conv.jsonl", blocks_a_turn=24, gap_s=4.0)  # up to 48k tokens, past 32k
    r = replay(mock_mesh, trace, tmp_path / "scaled", "--seed", "1", "--time-scale", "2")
    (p,) = r["points"]
    t = p["trace"]
    # Sent at the trace's times halved, never before (requests are in arrival order).
    times = sorted(json.loads(line)["timestamp"] / 1e3 for line in trace.read_text().splitlines())
    assert all(q["start"] >= at / 2 - 1e-3 for q, at in zip(p["requests"], times))
    assert t["scale"] == 2 and t["block_tokens"] == 256 and p["summary"]["num_ok"] == 20
    assert max(q["input_tokens"] for q in p["requests"]) == (96 * 512 - 100) // 2
    assert abs(t["achieved"]["hit_rate"] - t["implied_hit_rate"]) <= 0.05, t
