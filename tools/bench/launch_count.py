"""Counting what a step asks of the device: kernel launches and host syncs, by scope.

Counted at torch's dispatch level (a TorchDispatchMode), so it sees the op stream a
device gets, whatever the device is: every compute op is one launch; views and bare
allocations are none (they launch nothing). A Triton kernel is one launch, and the ops
the interpreter runs on its behalf (TRITON_INTERPRET=1, on a CPU) are not counted.

A host sync is an op whose result the host must wait for on an asynchronous device:
reading a value (`.item()`, `int(t)`, `bool(t)`), the ops whose output size depends
on the data (`nonzero`, boolean-mask indexing, `masked_select`, `unique`, ...), and a
copy from one device to another made with torch's default `non_blocking=False`, which
synchronizes the stream (`torch.tensor(values, device=cuda)` is one).
`.tolist()` and `.cpu()` of a CPU tensor do not dispatch, so on a CPU they are not seen:
the count covers what the model does on the device, and the step's one read of its
sampled ids is counted by the caller (bench/launches.py).

Scopes are set by the caller (`counter.scope = ...`) and by forward hooks on modules
(`counter.hook(module, name)`): each op is charged to the innermost scope.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that make or describe storage without computing anything.
_FREE = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.lift_fresh.default, aten.detach.default, aten.alias.default,
    aten._unsafe_view.default, aten.set_.source_Storage_storage_offset, aten.resize_.default,
    aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
    aten.lift_fresh_copy.default, aten.detach_.default,
}
# Ops whose result the host waits for on an asynchronous device.
_SYNC = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.is_nonzero.default,
    aten.equal.default, aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
    aten.repeat_interleave.Tensor, aten.bincount.default, aten.argwhere.default,
}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _is_free(func) -> bool:
    return func in _FREE or func.is_view or not _returns_tensor(func)


def _returns_tensor(func) -> bool:
    """Ops that return no tensor (dtype promotion, sizes) compute nothing on the device."""
    return any("Tensor" in str(r.type) for r in func._schema.returns)


def _is_waiting_copy(func, args, kwargs) -> bool:
    """A copy onto another device that the host waits for (a CPU run never makes one)."""
    if func is aten._to_copy.default:
        dst = kwargs.get("device")
        return dst is not None and torch.device(dst) != args[0].device and not kwargs.get("non_blocking", False)
    if func is aten.copy_.default:
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return args[0].device != args[1].device and not non_blocking
    return False


def _is_sync(func, args, kwargs=None) -> bool:
    if _is_waiting_copy(func, args, kwargs or {}):
        return True
    if func in _SYNC:
        return not (func is aten.repeat_interleave.Tensor and len(args) > 1)
    if func in _BOOL_INDEXED and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
    return False


def _name(func) -> str:
    return func._schema.name.removeprefix("aten::")


class LaunchCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.launches: dict[str, Counter] = defaultdict(Counter)  # scope -> op -> count
        self.syncs: dict[str, Counter] = defaultdict(Counter)
        self.scope = "other"
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused:
            if not _is_free(func):
                self.launches[self.scope][_name(func)] += 1
            if _is_sync(func, args, kwargs):
                self.syncs[self.scope][_name(func)] += 1
        return func(*args, **(kwargs or {}))

    def launch(self, name: str) -> None:
        """One launch of a kernel the counter does not see through torch (Triton)."""
        if not self._paused:
            self.launches[self.scope][name] += 1

    @contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextmanager
    def scoped(self, name: str):
        old, self.scope = self.scope, name
        try:
            yield
        finally:
            self.scope = old

    def hook(self, module: torch.nn.Module, name: str) -> list:
        """Charge what module's forward does to `name`. Returns the hook handles."""
        saved: list[str] = []

        def pre(mod, args):
            saved.append(self.scope)
            self.scope = name

        def post(mod, args, out):
            self.scope = saved.pop()

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def total(self, what: str = "launches", prefix: str = "") -> int:
        table = self.launches if what == "launches" else self.syncs
        return sum(sum(c.values()) for s, c in table.items() if s.startswith(prefix))

    def top(self, n: int, what: str = "launches") -> list[tuple[str, int]]:
        table = self.launches if what == "launches" else self.syncs
        out: Counter = Counter()
        for c in table.values():
            out.update(c)
        return out.most_common(n)


@contextmanager
def counting_triton(counter: LaunchCounter):
    """Each Triton launch counts once, and what the interpreter does for it not at all."""
    from moemesh.shared.kernels._triton import LazyKernel

    orig = LazyKernel.__getitem__

    def getitem(kernel, grid):
        launch = orig(kernel, grid)

        def call(*args, **kwargs):
            counter.launch(f"triton.{kernel.fn.__name__.lstrip('_')}")
            with counter.paused():
                return launch(*args, **kwargs)

        return call

    LazyKernel.__getitem__ = getitem
    try:
        yield
    finally:
        LazyKernel.__getitem__ = orig
