"""Pack a request's scattered cache blocks into one contiguous buffer, and unpack it.

L = cache layers, NB = blocks in the pool, n = blocks moved, bs = block size (tokens),
D = per-token width. The cache is [L, NB, bs, D]; a packed buffer is [L, n, bs, D], the
same layout restricted to the listed blocks, so a transport can move it as raw bytes.
"""

from __future__ import annotations

import torch

from moemesh.shared.kernels._triton import jit, next_pow2, tl
from moemesh.shared.kernels.dispatch import use_triton


def kv_gather_ref(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [L, NB, bs, D], block_ids [n] -> [L, n, bs, D] (into `out` when given)."""
    if out is None:
        return cache.index_select(1, block_ids)
    torch.index_select(cache, 1, block_ids, out=out)
    return out


def kv_scatter_ref(cache: torch.Tensor, block_ids: torch.Tensor, buf: torch.Tensor) -> None:
    """Writes buf [L, n, bs, D] into cache blocks block_ids [n], converting to cache's dtype."""
    cache.index_copy_(1, block_ids, buf.to(device=cache.device, dtype=cache.dtype))


@jit
def _kv_pack_kernel(
    cache_ptr, buf_ptr, ids_ptr,
    num_ids, block_numel, stride_cl, stride_cb,
    SCATTER: tl.constexpr, BLOCK: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    block = tl.load(ids_ptr + j).to(tl.int64)
    in_cache = cache_ptr + layer * stride_cl + block * stride_cb + offs
    in_buf = buf_ptr + (layer * num_ids + j) * block_numel + offs
    if SCATTER:
        tl.store(in_cache, tl.load(in_buf, mask=mask).to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(in_buf, tl.load(in_cache, mask=mask).to(buf_ptr.dtype.element_ty), mask=mask)


def _launch(cache: torch.Tensor, block_ids: torch.Tensor, buf: torch.Tensor, scatter: bool) -> None:
    L, _, bs, D = cache.shape
    n = block_ids.shape[0]
    if cache.stride(3) != 1 or cache.stride(2) != D:
        raise ValueError("each cache block must be contiguous ([bs, D] with unit strides)")
    if not buf.is_contiguous():
        raise ValueError("the packed buffer must be contiguous")
    if n == 0 or L == 0 or bs * D == 0:
        return
    block = min(2048, next_pow2(bs * D))  # 4096 spills registers at 4 warps on sm_90
    grid = (L, n, -(-(bs * D) // block))
    _kv_pack_kernel[grid](
        cache, buf, block_ids.to(cache.device).contiguous(), n, bs * D, cache.stride(0), cache.stride(1),
        SCATTER=scatter, BLOCK=block, num_warps=4,
    )


def _check(cache: torch.Tensor, block_ids: torch.Tensor, buf: torch.Tensor | None) -> None:
    if cache.dim() != 4 or block_ids.dim() != 1:
        raise ValueError(f"cache must be [L, NB, bs, D] and block_ids [n]; "
                         f"got {tuple(cache.shape)}, {tuple(block_ids.shape)}")
    if buf is not None:
        expect = (cache.shape[0], block_ids.shape[0], *cache.shape[2:])
        if tuple(buf.shape) != expect:
            raise ValueError(f"KV buffer has shape {tuple(buf.shape)}, expected {expect}")


def kv_gather(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kv_gather_ref."""
    _check(cache, block_ids, out)
    if not use_triton(cache):
        return kv_gather_ref(cache, block_ids, out)
    shape = (cache.shape[0], block_ids.shape[0], *cache.shape[2:])
    if out is not None and out.device == cache.device and out.is_contiguous():
        _launch(cache, block_ids, out, scatter=False)
        return out
    packed = torch.empty(shape, dtype=cache.dtype if out is None else out.dtype, device=cache.device)
    _launch(cache, block_ids, packed, scatter=False)
    # A staging buffer elsewhere (pinned host memory for a transport) takes one copy.
    return packed if out is None else out.copy_(packed)


def kv_scatter(cache: torch.Tensor, block_ids: torch.Tensor, buf: torch.Tensor) -> None:
    """Same contract as kv_scatter_ref."""
    _check(cache, block_ids, buf)
    if not use_triton(cache):
        kv_scatter_ref(cache, block_ids, buf)
        return
    if buf.device != cache.device:
        buf = buf.to(cache.device)
    _launch(cache, block_ids, buf.contiguous(), scatter=True)
