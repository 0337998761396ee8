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
