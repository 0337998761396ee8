"""DeepSeek-V4's hyper-connections in one launch each: the mix entering a block, and
the merge leaving it (shared/model/v4/hyper.py is the model's readable path).

Shapes: T = tokens, N = hc_mult streams, D = hidden size, W = (2 + N) * N mix weights.

- hc_mix: from `mixes` = streams.flatten(1) @ fn.T (one GEMM, outside: it is the only
  part with real arithmetic) and the streams themselves, per token: the RMS scale of the
  flattened streams (unit_rms(x) @ fn.T = rstd * (x @ fn.T)), the gates `pre` = sigmoid
  + eps and `post` = 2 * sigmoid, the mixing matrix `comb` = softmax + eps and then
  Sinkhorn-Knopp (column, then `iters - 1` times row and column), and the collapsed
  input sum_n pre[n] * streams[n]. In torch that is ~135 launches, most of them the
  Sinkhorn iterations' small sums and divides. `full=False` is the LM head's collapse
  (pre only, W = N, one scale).
- hc_merge: new stream k = post[k] * out + sum_j comb[j, k] * stream j.
"""

from __future__ import annotations

import torch

from moemesh.shared.kernels._triton import jit, next_pow2, rows_per_program, tl
from moemesh.shared.kernels.dispatch import use_triton


def hc_mix_ref(mixes: torch.Tensor, streams: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
               hc_eps: float, norm_eps: float, full: bool = True):
    """mixes [T, W] (unnormalised, fp32), streams [T, N, D], base [W], scale [3] (or [1]).
    Returns (post [T, N], comb [T, N, N], collapsed [T, D]); with full=False only collapsed."""
    T, N, D = streams.shape
    rstd = torch.rsqrt(streams.flatten(1).float().square().mean(-1, keepdim=True) + norm_eps)
    mixes = mixes.float() * rstd
    if not full:
        pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = base.float().split([N, N, N * N])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(T, N, N) * s_comb + comb_b.view(N, N), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


@jit
def _hc_mix_kernel(
    mix_ptr, x_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
    T, N, D, stride_mix, stride_x, stride_out, hc_eps, norm_eps,
    ITERS: tl.constexpr, FULL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """BLOCK_T tokens per program: streams as [BLOCK_T, BLOCK_N, BLOCK_D] tiles, the
    mixing matrices as [BLOCK_T, BLOCK_N, BLOCK_N] (row i, column k)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < T
    n = tl.arange(0, BLOCK_N)
    nm = n < N
    d = tl.arange(0, BLOCK_D)
    tn = tm[:, None] & nm[None, :]
    x_rows = x_ptr + t[:, None, None] * stride_x + n[None, :, None] * D
    # The RMS scale of each token's N * D values.
    ss = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        m = tn[:, :, None] & (d0 + d < D)[None, None, :]
        v = tl.load(x_rows + d0 + d[None, None, :], mask=m, other=0.0).to(tl.float32)
        ss += v * v
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(ss, axis=2), axis=1) / (N * D) + norm_eps)  # [BLOCK_T]
    mix_rows = mix_ptr + t[:, None] * stride_mix
    pre = tl.load(mix_rows + n[None, :], mask=tn, other=0.0) * rstd[:, None] * tl.load(scale_ptr)
    pre = pre + tl.load(base_ptr + n, mask=nm, other=0.0)[None, :]
    pre = tl.where(tn, 1.0 / (1.0 + tl.exp(-pre)) + hc_eps, 0.0)
    if FULL:
        post = tl.load(mix_rows + N + n[None, :], mask=tn, other=0.0) * rstd[:, None] * tl.load(scale_ptr + 1)
        post = 2.0 / (1.0 + tl.exp(-(post + tl.load(base_ptr + N + n, mask=nm, other=0.0)[None, :])))
        tl.store(post_ptr + t[:, None] * N + n[None, :], post, mask=tn)
        ij = n[:, None] * N + n[None, :]  # [i, k]
        cm = tm[:, None, None] & (nm[:, None] & nm[None, :])[None, :, :]
        c = tl.load(mix_ptr + t[:, None, None] * stride_mix + 2 * N + ij[None, :, :], mask=cm, other=0.0)
        c = c * rstd[:, None, None] * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + ij, mask=cm, other=0.0)
        c = tl.where(cm, c, float("-inf"))
        top = tl.where(tn, tl.max(c, axis=2), 0.0)  # padding rows (i >= N, or no token) are all -inf
        c = tl.exp(c - top[:, :, None])
        total = tl.where(tn, tl.sum(c, axis=2), 1.0)
        c = tl.where(cm, c / total[:, :, None] + hc_eps, 0.0)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
            c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + t[:, None, None] * N * N + ij[None, :, :], c, mask=cm)
    for d0 in range(0, D, BLOCK_D):
        m = tn[:, :, None] & (d0 + d < D)[None, None, :]
        v = tl.load(x_rows + d0 + d[None, None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.sum(pre[:, :, None] * v, axis=1)
        tl.store(out_ptr + t[:, None] * stride_out + d0 + d[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=tm[:, None] & (d0 + d < D)[None, :])


def hc_mix(mixes: torch.Tensor, streams: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float, full: bool = True):
    """Same contract as hc_mix_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel."""
    if not use_triton(streams):
        return hc_mix_ref(mixes, streams, base, scale, iters, hc_eps, norm_eps, full)
    T, N, D = streams.shape
    W = (2 + N) * N if full else N
    if mixes.shape != (T, W) or mixes.dtype != torch.float32:
        raise ValueError(f"mixes {tuple(mixes.shape)} {mixes.dtype}: expected ({T}, {W}) float32")
    x = streams.contiguous()
    mixes = mixes.contiguous()
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    post = torch.empty(T, N, dtype=torch.float32, device=x.device) if full else out
    comb = torch.empty(T, N, N, dtype=torch.float32, device=x.device) if full else out
    if T:
        block_n, block_d = next_pow2(N), min(256, next_pow2(D))
        block_t = rows_per_program(T, max(1, min(16, 4096 // (block_n * block_d))), block_n * block_d)
        _hc_mix_kernel[(-(-T // block_t),)](
            mixes, x, base.float().contiguous(), scale.float().contiguous(), post, comb, out,
            T, N, D, mixes.stride(0), x.stride(0), out.stride(0), hc_eps, norm_eps,
            ITERS=iters, FULL=full, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_D=block_d,
        )
    return (post, comb, out) if full else out


def hc_merge_ref(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams [T, N, D], out [T, D], post [T, N], comb [T, N, N] -> new streams [T, N, D].
    comb is read transposed (new stream k = sum_j comb[j, k] * stream j)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@jit
def _hc_merge_kernel(
    x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, T, N, D, stride_x, stride_o, stride_y,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """BLOCK_T tokens by BLOCK_D columns per program; one output stream k at a time."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < T
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    j = tl.arange(0, BLOCK_N)
    tj = tm[:, None] & (j < N)[None, :]
    x = tl.load(x_ptr + t[:, None, None] * stride_x + j[None, :, None] * D + d[None, None, :],
                mask=tj[:, :, None] & dm[None, None, :], other=0.0).to(tl.float32)  # [t, j, d]
    o = tl.load(o_ptr + t[:, None] * stride_o + d[None, :], mask=tm[:, None] & dm[None, :],
                other=0.0).to(tl.float32)
    for k in range(0, N):
        c = tl.load(comb_ptr + t[:, None] * N * N + j[None, :] * N + k, mask=tj, other=0.0)  # comb[t, j, k]
        p = tl.load(post_ptr + t * N + k, mask=tm, other=0.0)
        y = p[:, None] * o + tl.sum(c[:, :, None] * x, axis=1)
        tl.store(y_ptr + t[:, None] * stride_y + k * D + d[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=tm[:, None] & dm[None, :])


def hc_merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Same contract as hc_merge_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel."""
    if not use_triton(streams):
        return hc_merge_ref(streams, out, post, comb)
    T, N, D = streams.shape
    if out.shape != (T, D) or post.shape != (T, N) or comb.shape != (T, N, N):
        raise ValueError(f"hc_merge: out {tuple(out.shape)}, post {tuple(post.shape)}, comb {tuple(comb.shape)} "
                         f"do not fit streams {tuple(streams.shape)}")
    x, o = streams.contiguous(), out.contiguous()
    y = torch.empty_like(x)
    if T:
        block_n, block_d = next_pow2(N), min(128, next_pow2(D))
        block_t = rows_per_program(T, max(1, min(16, 4096 // (block_n * block_d))), block_n * block_d)
        _hc_merge_kernel[(-(-T // block_t), -(-D // block_d))](
            x, o, post.float().contiguous(), comb.float().contiguous(), y, T, N, D, x.stride(0), o.stride(0),
            y.stride(0), BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_D=block_d,
        )
    return y
