"""The engine with every kernel forced on (interpreted on CPU) generates exactly what the
torch path generates; tests/oracle ties the torch path to transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.engine_check import NEW_TOKENS


@pytest.mark.timeout(280)
def test_greedy_output_is_unchanged_with_kernels_forced_on(tiny_model):
    pytest.importorskip("triton")
    # A fresh process: there TRITON_INTERPRET=1 precedes every import of triton.
    env = dict(os.environ, TRITON_INTERPRET="1", MOEMESH_KERNELS="torch")
    res = subprocess.run(
        [sys.executable, "-m", "tests.kernels.engine_check", tiny_model],
        capture_output=True, text=True, timeout=270, env=env, cwd=Path(__file__).resolve().parents[2],
    )
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(len(v) == NEW_TOKENS for v in out["torch"]["batched"].values())
    assert out["triton"] == out["torch"]
    idle = [name for name, n in out["launches"].items() if n == 0]
    assert not idle, f"kernels never launched: {idle}"


@pytest.mark.timeout(280)
def test_v4_greedy_output_is_unchanged_with_kernels_forced_on(tiny_v4_model):
    """DeepSeek-V4 runs the RMSNorm and the fused MoE kernels (SwiGLU clipping included);
    its attention, rotary and cache moves are torch."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", MOEMESH_KERNELS="torch")
    res = subprocess.run(
        [sys.executable, "-m", "tests.kernels.engine_check", tiny_v4_model],
        capture_output=True, text=True, timeout=270, env=env, cwd=Path(__file__).resolve().parents[2],
    )
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(len(v) == NEW_TOKENS for v in out["torch"]["batched"].values())
    assert out["triton"] == out["torch"]
    assert out["launches"]["rms_norm"] > 0 and out["launches"]["fused_moe"] > 0
