"""The GPU benchmark's harness, run end to end on tiny shapes under the interpreter, so
that a GPU session finds a script that works rather than one that was never run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moemesh.tools.bench.kernels_gpu import Hardware, parse_args, table

OPS = {"rms_norm+residual", "rotary", "kv_gather", "kv_scatter", "mla_decode", "fused_moe"}


@pytest.mark.timeout(200)
@pytest.mark.slow  # the GPU harness end to end under the interpreter; tests/kernels checks every kernel
def test_smoke_run_covers_every_kernel_and_the_forward_sweep(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "moemesh.tools.bench.kernels_gpu", "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=180, env=env, cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["kernels"]
    assert {r["op"] for r in rows} == OPS and not [r for r in rows if "error" in r]
    assert all(r["max_abs_err"] < 1e-4 and r["triton_ms"] > 0 and r["roofline_ms"] > 0 for r in rows)
    fwd = result["forward"]
    assert [r["batch"] for r in fwd["torch"]] == [r["batch"] for r in fwd["triton"]] == [1, 2]
    assert "mla_decode" in res.stdout and "decode forward" in res.stdout


def test_roofline_figures_and_defaults():
    cfg = parse_args([])
    assert cfg.hardware == Hardware() and cfg.hardware.hbm_bytes_per_s == 4.8e12
    assert cfg.device == "cuda" and cfg.dtype == "bfloat16" and cfg.forward
    row = {"op": "x", "shape": "s", "triton_ms": 2.0, "torch_ms": 4.0, "roofline_ms": 1.0, "speedup_vs_torch": 2.0,
           "fraction_of_roofline": 0.5, "achieved_gb_per_s": 10.0, "achieved_tflop_per_s": 0.0, "max_abs_err": 0.0}
    text = table({"kernels": [row, {"op": "y", "error": "boom"}], "forward": {"skipped": "time budget spent"}})
    assert "50.0" in text and "boom" in text and "time budget spent" in text
