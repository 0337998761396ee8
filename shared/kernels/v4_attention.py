"""DeepSeek-V4's decode attention in one launch: each decode row's window keys and its
compressed entries, with the heads' sink logits, read where they lie in the cache.

Shapes: B = decode rows, H = heads, d = head width, W = window, J = entries a row may
attend to (HCA: all of its sequence's, CSA: the indexer's top-k picks), Nc = ctx rows.
One KV head (MQA); a key is also its value. Sources:
- window: `ctx` rows (this batch's keys, then the pre positions read from the rings),
  `win` [B, W] indices into them, -1 before position 0;
- entries: the main cache's compressed entries, `entries` [blocks, per_block, d] (a
  strided view of the main rows), found through each row's block `table` [B, nb]:
  entry e sits at (table[b, e // per_block], e % per_block). HCA (`sel` None) reads
  entries 0 .. J-1; CSA reads `sel` [B, J]. An entry counts if it is below `visible[b]`.
The sink takes probability mass and gives nothing (its value is zero).

The torch path gathers [B, W + J, d] keys and runs ~25 ops; the kernel reads each key
once, in blocks, with an online softmax in fp32. Both keep the scores, the sink and the
softmax in fp32 and round the probabilities to the keys' dtype before the values.
"""

from __future__ import annotations

import torch

from moemesh.shared.kernels._triton import jit, next_pow2, tl
from moemesh.shared.kernels.dispatch import use_triton


def v4_decode_attention_ref(q: torch.Tensor, ctx: torch.Tensor, win: torch.Tensor, sinks: torch.Tensor, scale: float,
                            entries: torch.Tensor | None = None, table: torch.Tensor | None = None,
                            visible: torch.Tensor | None = None, count: int = 0,
                            sel: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, d]; returns [B, H, d] in q's dtype, computed as the model's torch path does."""
    keys = ctx[win.clamp(min=0)]  # [B, W, d]
    mask = win >= 0
    if entries is not None:
        per_block = entries.shape[1]
        e = torch.arange(count, device=q.device)[None, :].expand(q.shape[0], count) if sel is None else sel
        ek = entries[table.gather(1, e // per_block), e % per_block]
        keys = torch.cat([keys, ek.to(keys.dtype)], dim=1)
        mask = torch.cat([mask, e < visible[:, None]], dim=1)
    return attend_ref(q, keys, mask, sinks, scale)


def attend_ref(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
               scale: float) -> torch.Tensor:
    """The attention itself, also the model's torch path (model/v4/attention.py): q [R, H, d];
    keys (also the values) [R, L, d], one set a row, or [L, d] shared by the rows; mask
    [R, L]; sinks [H] fp32. Returns [R, H, d] in the keys' dtype. The scores, the sink and
    the softmax stay in fp32 (in bf16, the sink and the max subtracted from every score
    were rounded too)."""
    eq = "rhd,rld->rhl" if keys.dim() == 3 else "rhd,ld->rhl"
    s = torch.einsum(eq, q.float(), keys.float()) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(s.shape[0], -1, 1)
    logits = torch.cat([s, sink], dim=-1)
    p = (logits - logits.max(dim=-1, keepdim=True).values).softmax(dim=-1)[..., :-1]
    return torch.einsum("rhl,rld->rhd" if keys.dim() == 3 else "rhl,ld->rhd", p.to(keys.dtype), keys)


@jit
def _v4_decode_attn_kernel(
    q_ptr, ctx_ptr, win_ptr, ent_ptr, table_ptr, sel_ptr, vis_ptr, sink_ptr, out_ptr,
    H, d, W, J, per_block, scale,
    stride_qb, stride_qh, stride_ctx, stride_win, stride_eb, stride_es, stride_table, stride_sel,
    MODE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One decode row and BLOCK_H heads per program. MODE 0: window only; 1: + entries
    0 .. J-1 (HCA); 2: + the selected entries sel[b] (CSA)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    dd = tl.arange(0, BLOCK_D)
    dm = dd < d
    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + dd[None, :], mask=hm[:, None] & dm[None, :],
                other=0.0)
    kk = tl.arange(0, BLOCK_K)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    n_keys = W + (J if MODE > 0 else 0)
    vis = tl.load(vis_ptr + b) if MODE > 0 else 0
    for k0 in range(0, n_keys, BLOCK_K):
        j = k0 + kk
        in_win = j < W
        idx = tl.load(win_ptr + b * stride_win + j, mask=in_win, other=-1)
        valid = in_win & (idx >= 0)
        rows = ctx_ptr + tl.maximum(idx, 0) * stride_ctx
        if MODE > 0:
            je = j - W
            in_ent = (j >= W) & (je < J)
            if MODE == 1:
                e = je.to(tl.int64)
            else:
                e = tl.load(sel_ptr + b * stride_sel + je, mask=in_ent, other=0).to(tl.int64)
            blk = tl.load(table_ptr + b * stride_table + e // per_block, mask=in_ent, other=0).to(tl.int64)
            ent_rows = ent_ptr + blk * stride_eb + (e % per_block) * stride_es
            ok = in_ent & (e < vis)
            rows = tl.where(in_win, rows, ent_rows)
            valid = valid | ok
        k = tl.load(rows[:, None] + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_H, BLOCK_K]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet (a window before position 0)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
        m_i = m_new
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.exp(sink - m_new)
    out = acc * alpha[:, None] / l_i[:, None]
    tl.store(out_ptr + b * H * d + h[:, None] * d + dd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & dm[None, :])


def v4_decode_attention(q: torch.Tensor, ctx: torch.Tensor, win: torch.Tensor, sinks: torch.Tensor, scale: float,
                        entries: torch.Tensor | None = None, table: torch.Tensor | None = None,
                        visible: torch.Tensor | None = None, count: int = 0,
                        sel: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as v4_decode_attention_ref; CUDA tensors (or MOEMESH_KERNELS=triton)
    run the kernel."""
    if not use_triton(q):
        return v4_decode_attention_ref(q, ctx, win, sinks, scale, entries, table, visible, count, sel)
    B, H, d = q.shape
    W = win.shape[1]
    if ctx.shape[-1] != d or win.shape[0] != B:
        raise ValueError(f"v4_decode_attention: ctx {tuple(ctx.shape)} / win {tuple(win.shape)} do not fit q "
                         f"{tuple(q.shape)}")
    mode = 0 if entries is None else 1 if sel is None else 2
    J = 0 if mode == 0 else count if mode == 1 else sel.shape[1]
    if mode and (entries.shape[-1] != d or entries.stride(-1) != 1 or table.shape[0] != B):
        raise ValueError(f"v4_decode_attention: entries {tuple(entries.shape)} / table {tuple(table.shape)} do not "
                         f"fit q {tuple(q.shape)}")
    q, ctx, win = q.contiguous(), ctx.contiguous(), win.contiguous()
    out = torch.empty(B, H, d, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    dummy = win
    ent = entries if mode else ctx
    block_h, block_d, block_k, warps = attention_tiles(H, d, mode)
    _v4_decode_attn_kernel[(B, -(-H // block_h))](
        q, ctx, win, ent, table.contiguous() if mode else dummy, sel.contiguous() if mode == 2 else dummy,
        visible.contiguous() if mode else dummy, sinks.contiguous(), out,
        H, d, W, J, ent.shape[1] if mode else 1, float(scale),
        q.stride(0), q.stride(1), ctx.stride(0), win.stride(0), ent.stride(0), ent.stride(1) if mode else 0,
        table.stride(0) if mode else 0, sel.stride(0) if mode == 2 else 0,
        MODE=mode, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_K=block_k, num_warps=warps,
    )
    return out


def attention_tiles(H: int, d: int, mode: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_D, BLOCK_K, num_warps): 16 heads a program (tl.dot's least), the
    whole head width, keys in blocks of 16-64; at V4's 512-wide heads the entry modes
    need eight warps to keep their addressing and the fp32 accumulator in registers on
    sm_90, the window-only mode four (tests/kernels/compile_check.py)."""
    block_d = max(16, next_pow2(d))
    return 16, block_d, max(16, min(64, 8192 // block_d)), 8 if block_d >= 256 and mode else 4
