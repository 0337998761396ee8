"""Triton, loaded only when a kernel is about to run, and kernels decorated at launch.

`@jit` stands in for `@triton.jit`. Two things make a module-level `@triton.jit` the
wrong choice here. Triton is the optional "kernels" extra, and the torch path must
import without it. And triton settles compile-versus-interpret (`TRITON_INTERPRET=1`)
for a function when it is decorated, so decorating at import would fix the choice
before a test or a debugging session could make it. (Triton's own standard library is
settled when triton is first imported, which torch itself may do from torch._dynamo:
set TRITON_INTERPRET before the process starts work, as tests/kernels/conftest.py does.)

Kernel bodies name `tl`; their modules hold a placeholder (`tl` below, None) that the
first launch replaces with triton.language. Their parameter annotations stay
unevaluated strings (`from __future__ import annotations`), which triton reads as such.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

tl: Any = None


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def rows_per_program(rows: int, compiled: int, elems: int = 1) -> int:
    """How many rows a program takes: `compiled` on a GPU (its tiles, checked by
    tests/kernels/compile_check.py); under the interpreter as many as there are, up to
    64, since it runs programs one after another at a fixed cost each. `elems`: a row's
    tile size, so a program's tile stays under 32k elements either way."""
    cap = 64 if interpreting() else compiled
    return max(1, min(cap, next_pow2(rows), 32768 // max(1, elems)))


class LazyKernel:
    """A kernel body that becomes a triton JIT (or interpreted) function when launched."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.num_launches = 0  # lets tests prove the kernel, not the reference, ran
        self._compiled: dict[bool, Any] = {}
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        self.num_launches += 1
        mode = interpreting()
        kernel = self._compiled.get(mode)
        if kernel is None:
            import triton
            import triton.language

            self.fn.__globals__["tl"] = triton.language
            kernel = self._compiled[mode] = triton.jit(self.fn)
        # Triton 3.9 warns when FMA contraction is left to its default, which changes in
        # 3.10; stating it keeps results stable across versions (and the warning away).
        return functools.partial(kernel[grid], enable_fp_fusion=True)


def jit(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)
