"""`moemesh bench kv-bytes`: the figures docs/benchmarks.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from moemesh.tools.bench import kv_bytes


def test_v4_flash_against_v3():
    rows = {r["model"]: r for r in kv_bytes.run(torch.bfloat16, num_spec=1)["rows"]}
    flash = rows["V4-Flash"]
    # 21 CSA layers keep (512 + 128) / 4 values per token, 20 HCA layers 512 / 128.
    assert flash["bytes_per_token"] == (21 * 160 + 20 * 4) * 2 == 6880
    assert rows["V3 at V4-Flash's layer count"]["bytes_per_token"] == 44 * 576 * 2
    assert rows["V3 (published)"]["bytes_per_token"] == 62 * 576 * 2
    assert round(flash["vs_v3_same_layers"], 3) == 0.136
    # The ring does not grow with the context: at 1M tokens it is 0.2% of the cache.
    per_seq = flash["per_sequence_bytes"]
    assert per_seq[str(1 << 20)] - 6880 * (1 << 20) == flash["ring_bytes"] < 13 << 20


def test_cli_prints_and_saves(tmp_path):
    out = tmp_path / "kv.json"
    res = subprocess.run([sys.executable, "-m", "moemesh.tools.cli.main", "bench", "kv-bytes", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "V4-Flash" in res.stdout and "6,880" in res.stdout
    assert json.loads(out.read_text())["rows"][0]["model"] == "V4-Flash"


def test_handoff_sizes_are_whole_blocks_plus_the_ring_lookback():
    rows = {(r["cache"], r["context_len"]): r["bytes"] for r in kv_bytes.handoff_sizes((2048, 2049), torch.bfloat16)}
    flash = kv_bytes.run(torch.bfloat16, num_spec=1)["rows"][0]
    # V4-Flash: 16 blocks of 128 positions at 6,880 B/token, and the ring's look-back.
    assert rows[("V4-Flash", 2048)] == 2048 * 6880 + flash["handoff_carry_bytes"]
    assert rows[("V4-Flash", 2049)] == 2176 * 6880 + flash["handoff_carry_bytes"]  # a 17th whole block
    assert 11 << 20 < flash["handoff_carry_bytes"] < 12 << 20
    # MLA: whole 16-token blocks of 576 values per layer, nothing carried.
    assert rows[("V3 (published)", 2048)] == 62 * 2048 * 576 * 2
    assert rows[("V3 at V4-Flash's layer count", 2049)] == 44 * 2064 * 576 * 2
