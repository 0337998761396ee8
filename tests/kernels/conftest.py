"""Kernel tests run on CPU under the Triton interpreter, and compiled on CUDA when present.

A process gets one Triton mode: triton builds its standard library (tl.sum, tl.max...)
for the interpreter or for the compiler when it is first imported, and TRITON_INTERPRET
decides. That import is not ours to time (torch itself imports triton from
torch._dynamo), so the mode is settled here, while tests are still being collected:
the interpreter on a machine without CUDA, or when TRITON_INTERPRET=1 is set for the
run; otherwise the compiler, and the CPU cases are skipped.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"


def _imported_mode() -> bool | None:
    """True/False once triton is imported in interpreter/compiler mode; None before."""
    std = sys.modules.get("triton.language.standard")
    if std is None:
        return None
    return type(getattr(std, "sum", None)).__name__ == "InterpretedFunction"


@pytest.fixture
def force_triton(monkeypatch):
    """Call with the test's device; the ops then launch their kernels (interpreted on CPU)."""

    def force(device: str) -> None:
        interpret = device == "cpu"
        if interpret != INTERPRET:
            pytest.skip("CPU cases need TRITON_INTERPRET=1 on a CUDA machine" if interpret
                        else "CUDA cases need a run without TRITON_INTERPRET")
        pytest.importorskip("triton")
        if _imported_mode() is not interpret:
            pytest.skip("triton was imported in the other mode before this conftest could choose")
        monkeypatch.setenv("MOEMESH_KERNELS", "triton")

    return force
