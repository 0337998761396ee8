from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moemesh.shared.kernels import dispatch
from moemesh.shared.kernels.rmsnorm import _rms_norm_kernel, rms_norm, rms_norm_ref


def test_cpu_tensors_take_the_reference_by_default(monkeypatch):
    monkeypatch.delenv("MOEMESH_KERNELS", raising=False)
    assert not dispatch.use_triton(torch.zeros(1))
    x, w = torch.randn(3, 8), torch.randn(8)
    before = _rms_norm_kernel.num_launches
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert _rms_norm_kernel.num_launches == before


@pytest.mark.parametrize("mode", ["torch", "TORCH", " torch "])
def test_torch_mode_is_the_reference(monkeypatch, mode):
    monkeypatch.setenv("MOEMESH_KERNELS", mode)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dispatch.use_triton(torch.zeros(1))


def test_forcing_triton_on_cpu_without_the_interpreter_says_how(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("MOEMESH_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.use_triton(torch.zeros(1))


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("MOEMESH_KERNELS", "cuda")
    with pytest.raises(ValueError, match="auto, triton, torch"):
        dispatch.use_triton(torch.zeros(1))


_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # as if the kernels extra were not installed
import torch
from moemesh.shared.kernels import dispatch
from moemesh.shared.model.deepseek import DeepseekForCausalLM
from moemesh.shared.engine.kv_cache import KVCache
from moemesh.shared.kernels.rmsnorm import rms_norm, rms_norm_ref
x, w = torch.randn(3, 8), torch.randn(8)
assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
assert not dispatch.triton_available()
import os
os.environ["MOEMESH_KERNELS"] = "triton"
try:
    dispatch.use_triton(x)
except RuntimeError as e:
    assert "not installed" in str(e)
else:
    raise AssertionError("forcing triton without it must fail")
print("ok")
"""


def test_the_torch_path_needs_no_triton():
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, timeout=120, cwd=root)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
