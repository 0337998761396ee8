"""Absorbed-weight MLA decode over the paged latent cache.

B = decode sequences, H = heads, N = nope dims, R = rope dims, C = latent (kv_lora_rank),
V = value dims, L = context length, S = splits of the context (flash-decoding).

The Triton path keeps the two small projections in torch (q_lat = q_nope . W_UK and
o = o_lat . W_UV) and runs the paged attention over [latent C | rope R] as two kernels:
each (sequence, head block, split) program walks its share of the context with an
online softmax, then a second kernel merges the splits by their log-sum-exp. Splitting
the context keeps the GPU busy when B * H / BLOCK_H is small, as it is in decode.
"""

from __future__ import annotations

import functools

import torch

from moemesh.shared.kernels._triton import jit, next_pow2, tl
from moemesh.shared.kernels.dispatch import use_triton


def mla_decode_ref(
    q_nope: torch.Tensor,  # [B, H, N]
    q_pe: torch.Tensor,  # [B, H, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, C + R]
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    w_uk: torch.Tensor,  # [H, N, C]
    w_uv: torch.Tensor,  # [H, V, C]
    scale: float,
) -> torch.Tensor:
    """Absorbed-weight MLA decode in plain torch. Returns [B, H, V]."""
    B = q_nope.shape[0]
    C = w_uk.shape[-1]
    bs = kv_cache.shape[1]
    ctx = kv_cache[block_tables].view(B, -1, kv_cache.shape[-1]).to(q_nope.dtype)  # [B, L, C + R]
    lat, k_pe = ctx[..., :C], ctx[..., C:]
    q_lat = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    # Scores stay in fp32 up to the softmax, as the kernel's accumulator and transformers'
    # attention (SDPA) keep them: rounded to bf16, a score of 8 moves by up to 0.03.
    scores = (torch.einsum("bhc,blc->bhl", q_lat.float(), lat.float())
              + torch.einsum("bhr,blr->bhl", q_pe.float(), k_pe.float())) * scale
    L = block_tables.shape[1] * bs
    valid = torch.arange(L, device=ctx.device)[None, :] < context_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q_nope.dtype)
    o_lat = torch.einsum("bhl,blc->bhc", p, lat)
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)


@jit
def _mla_decode_kernel(
    q_ptr, qpe_ptr, cache_ptr, bt_ptr, lens_ptr, part_o_ptr, part_lse_ptr,
    H, C, R, PAGE, scale, tokens_per_split,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_cblk, stride_ctok, stride_bt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    hmask = heads < H
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_c[None, :],
                mask=hmask[:, None] & (offs_c[None, :] < C), other=0.0)  # [BH, BC]
    qpe = tl.load(qpe_ptr + b * stride_pb + heads[:, None] * stride_ph + offs_r[None, :],
                  mask=hmask[:, None] & (offs_r[None, :] < R), other=0.0)  # [BH, BR]
    ctx_len = tl.load(lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx_len)

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = tl.load(bt_ptr + b * stride_bt + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        row = cache_ptr + page * stride_cblk + (offs_n % PAGE) * stride_ctok  # [BN]
        # The cache is rounded to q's dtype before the products, as the reference does.
        lat = tl.load(row[:, None] + offs_c[None, :], mask=nmask[:, None] & (offs_c[None, :] < C),
                      other=0.0).to(q.dtype)  # [BN, BC]
        kpe = tl.load(row[:, None] + C + offs_r[None, :], mask=nmask[:, None] & (offs_r[None, :] < R),
                      other=0.0).to(q.dtype)  # [BN, BR]
        s = tl.dot(q, tl.trans(lat), input_precision=PRECISION)
        s = tl.dot(qpe, tl.trans(kpe), s, input_precision=PRECISION) * scale  # [BH, BN]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(q.dtype), lat, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new

    # A split past the end of a short context holds nothing: weight zero in the merge.
    has = l > 0
    o = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(part_o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_c[None, :],
             o, mask=hmask[:, None] & (offs_c[None, :] < C))
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@jit
def _mla_decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, C, num_splits,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    smask = splits < num_splits
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + splits, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    o = tl.load(part_o_ptr + b * stride_ob + h * stride_oh + splits[:, None] * stride_os + offs_c[None, :],
                mask=smask[:, None] & (offs_c[None, :] < C), other=0.0)
    res = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + offs_c, res.to(out_ptr.dtype.element_ty), mask=offs_c < C)


def _tiles(C: int, R: int, dtype: torch.dtype) -> dict:
    """Constexprs and launch options of _mla_decode_kernel. tl.dot wants 16 or more in
    every dimension, so heads come 16 at a time (the extra rows masked). BLOCK_N=32
    spills registers at C=512 on sm_90 (cuobjdump); 16 does not."""
    block_c = max(16, next_pow2(C))
    return dict(BLOCK_H=16, BLOCK_N=16, BLOCK_C=block_c, BLOCK_R=max(16, next_pow2(R)),
                PRECISION="ieee" if dtype == torch.float32 else "tf32",
                num_warps=8 if block_c >= 256 else 4, num_stages=2)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pick_splits(B: int, num_head_blocks: int, max_len: int, block_n: int, device: torch.device) -> int:
    programs = 2 * _num_sms(device.index or 0) if device.type == "cuda" else 4
    want = -(-programs // max(1, B * num_head_blocks))
    return max(1, min(want, -(-max_len // block_n), 64))


def mla_decode(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as mla_decode_ref. `num_splits` overrides the context split (tests)."""
    if not use_triton(q_nope):
        return mla_decode_ref(q_nope, q_pe, kv_cache, block_tables, context_lens, w_uk, w_uv, scale)
    B, H, N = q_nope.shape
    C, R, V = w_uk.shape[-1], q_pe.shape[-1], w_uv.shape[1]
    if q_pe.shape[:2] != (B, H) or w_uk.shape != (H, N, C) or w_uv.shape != (H, V, C):
        raise ValueError(f"mla_decode shapes disagree: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, "
                         f"w_uk {tuple(w_uk.shape)}, w_uv {tuple(w_uv.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != C + R or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be [blocks, block_size, {C + R}] with unit last stride, "
                         f"got {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
                         f"do not match B={B}")
    if B == 0:
        return q_nope.new_empty(B, H, V)
    page = kv_cache.shape[1]
    q_lat = torch.einsum("bhn,hnc->bhc", q_nope, w_uk).contiguous()  # [B, H, C]
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    block_tables = block_tables.contiguous()
    tiles = _tiles(C, R, q_lat.dtype)
    block_n = tiles["BLOCK_N"]
    head_blocks = -(-H // tiles["BLOCK_H"])
    max_len = block_tables.shape[1] * page
    splits = num_splits or _pick_splits(B, head_blocks, max_len, block_n, q_nope.device)
    per_split = -(-max(1, -(-max_len // splits)) // block_n) * block_n
    splits = max(1, -(-max_len // per_split))
    part_o = torch.empty(B, H, splits, C, dtype=torch.float32, device=q_nope.device)
    part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q_nope.device)
    _mla_decode_kernel[(B, head_blocks, splits)](
        q_lat, q_pe, kv_cache, block_tables, context_lens, part_o, part_lse,
        H, C, R, page, scale, per_split,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        **tiles,
    )
    o_lat = torch.empty(B, H, C, dtype=q_nope.dtype, device=q_nope.device)
    chunk = min(128, next_pow2(C))  # a [splits, C] tile of fp32 would not fit in registers
    _mla_decode_reduce_kernel[(B, H, -(-C // chunk))](
        part_o, part_lse, o_lat, C, splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        o_lat.stride(0), o_lat.stride(1),
        BLOCK_S=next_pow2(splits), BLOCK_C=chunk, num_warps=4,
    )
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)
