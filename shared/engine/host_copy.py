"""Moving a step's small values between host and device: reading device values on the
host, the one wait a decode step may have, and putting host lists on the device, which
must not wait at all.

Each read of a device tensor (`.cpu()`, `.tolist()`, `.item()`) stops the host until
the device has caught up. A step that needs several values (the target's logits and
the MTP drafts proposed the step before) reads them here together: the copies are
queued without waiting, then the host waits once.

The other way, `torch.tensor(values, device=cuda)` copies with torch's default
`non_blocking=False`, which synchronizes the stream: the host would wait for the
forward queued before it. `send` (and `to_device`, for a list) copies from pinned memory
without blocking, as the batch's inputs go: the copy is queued behind the work before
it, and the host goes on.
"""

from __future__ import annotations

import torch


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the CPU (those already there as they are), after one wait. Callers
    reach it as host_copy.to_host, so that the launch accounting can count the waits."""
    dev = [t for t in tensors if t.device.type != "cpu"]
    if not dev:
        return list(tensors)
    out = []
    for t in tensors:
        if t.device.type == "cpu":
            out.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        out.append(host)
    if any(t.is_cuda for t in dev):
        torch.cuda.current_stream(dev[0].device).synchronize()
    return out


def send(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queue: on CUDA from
    pinned memory, so the copy is queued behind the work before it. On the CPU, t itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or nested lists) as a tensor on `device`, as send() puts it there."""
    return send(torch.tensor(values, dtype=dtype), device)
