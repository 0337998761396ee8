"""The engine with every kernel forced on (interpreted on CPU) generates exactly what the
torch path generates; tests/oracle ties the torch path to transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.engine_check import NEW_TOKENS, V4_ONLY


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
    idle = [name for name, n in out["launches"].items() if n == 0 and name not in V4_ONLY]
    assert not idle, f"kernels never launched: {idle}"


@pytest.mark.timeout(280)
def test_v4_greedy_output_is_unchanged_with_kernels_forced_on(tiny_v4_model):
    """DeepSeek-V4 runs the RMSNorm, routing, fused MoE (SwiGLU clipping included),
    hyper-connection, rotary, decode attention and indexer kernels; its prefill
    attention, the compressors' pooling and the cache moves are torch."""
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
    for name in ("rms_norm", "fused_moe", "route", *V4_ONLY):
        assert out["launches"][name] > 0, name
