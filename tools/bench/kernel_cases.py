"""The shapes `bench_gpu` times, each with the bytes it must move and the flops it must do.

Shapes are DeepSeek-V3's (D=7168, H=128, C=512, R=64, N=V=128, 256 routed experts,
top-8, I=2048) at decode and prefill batch sizes; `smoke` swaps in tiny ones so the
harness itself can run on CPU under the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from moemesh.shared.kernels.fused_moe import fused_moe, fused_moe_ref
from moemesh.shared.kernels.kv_pack import kv_gather, kv_gather_ref, kv_scatter, kv_scatter_ref
from moemesh.shared.kernels.mla_decode import mla_decode, mla_decode_ref
from moemesh.shared.kernels.rmsnorm import rms_norm, rms_norm_ref
from moemesh.shared.kernels.rotary import rotary, rotary_ref


@dataclass
class Case:
    op: str
    shape: str  # a short label, e.g. "B=32 L=4096"
    kernel: Callable[[], Any]  # the Triton path, through the dispatching entry point
    ref: Callable[[], Any]  # the torch reference
    bytes: float  # the least traffic to and from device memory
    flops: float


@dataclass(frozen=True)
class Dims:
    hidden: int = 7168
    heads: int = 128
    nope: int = 128
    rope: int = 64
    latent: int = 512
    v: int = 128
    experts: int = 256
    top_k: int = 8
    inter: int = 2048
    cache_layers: int = 5
    block_size: int = 16
    rows: tuple[int, ...] = (1, 32, 256, 4096)  # tokens for the elementwise ops
    moe_tokens: tuple[int, ...] = (1, 16, 128, 1024)
    decode_batches: tuple[int, ...] = (1, 32, 128)
    context_len: int = 4096
    kv_blocks: tuple[int, ...] = (16, 256)


SMOKE = Dims(hidden=96, heads=3, nope=16, rope=8, latent=32, v=16, experts=6, top_k=2, inter=24,
             cache_layers=2, block_size=4, rows=(1, 7), moe_tokens=(1, 7), decode_batches=(1, 3),
             context_len=9, kv_blocks=(1, 3))


def _rand(*shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def rms_norm_cases(d: Dims, dtype: torch.dtype, device: str) -> Iterator[Case]:
    it = dtype.itemsize
    w = _rand(d.hidden, dtype=dtype, device=device, scale=0.1) + 1
    for m in d.rows:
        x, res = _rand(m, d.hidden, dtype=dtype, device=device), _rand(m, d.hidden, dtype=dtype, device=device)
        yield Case("rms_norm+residual", f"M={m} D={d.hidden}", lambda x=x, r=res: rms_norm(x, w, 1e-6, r),
                   lambda x=x, r=res: rms_norm_ref(x, w, 1e-6, r), 4 * m * d.hidden * it + d.hidden * it,
                   4 * m * d.hidden)


def rotary_cases(d: Dims, dtype: torch.dtype, device: str) -> Iterator[Case]:
    it, half = dtype.itemsize, d.rope // 2
    cos = _rand(8192, half, dtype=torch.float32, device=device)
    sin = _rand(8192, half, dtype=torch.float32, device=device)
    for t in d.rows:
        q = _rand(t, d.heads, d.nope + d.rope, dtype=dtype, device=device)[..., d.nope:]  # the rope slice
        pos = torch.randint(0, 8192, (t,), device=device)
        yield Case("rotary", f"T={t} H={d.heads} R={d.rope}", lambda q=q, p=pos: rotary(q, cos, sin, p, True),
                   lambda q=q, p=pos: rotary_ref(q, cos, sin, p, True),
                   2 * t * d.heads * d.rope * it + t * d.rope * 4, 3 * t * d.heads * d.rope)


def kv_pack_cases(d: Dims, dtype: torch.dtype, device: str) -> Iterator[Case]:
    width = d.latent + d.rope
    pool = 4 * max(d.kv_blocks)
    cache = _rand(d.cache_layers, pool, d.block_size, width, dtype=dtype, device=device)
    for n in d.kv_blocks:
        ids = torch.randperm(pool, device=device)[:n]
        moved = d.cache_layers * n * d.block_size * width * dtype.itemsize
        label = f"L={d.cache_layers} blocks={n} bs={d.block_size}"
        yield Case("kv_gather", label, lambda ids=ids: kv_gather(cache, ids),
                   lambda ids=ids: kv_gather_ref(cache, ids), 2 * moved, 0)
        buf = kv_gather_ref(cache, ids)
        dst = torch.empty_like(cache)

        def scatter(fn: Callable[..., None], ids=ids, buf=buf) -> torch.Tensor:
            fn(dst, ids, buf)
            return dst[:, ids]

        yield Case("kv_scatter", label, lambda s=scatter: s(kv_scatter), lambda s=scatter: s(kv_scatter_ref),
                   2 * moved, 0)


def mla_decode_cases(d: Dims, dtype: torch.dtype, device: str) -> Iterator[Case]:
    it, L, bs = dtype.itemsize, d.context_len, d.block_size
    w_uk = _rand(d.heads, d.nope, d.latent, dtype=dtype, device=device, scale=d.nope**-0.5)
    w_uv = _rand(d.heads, d.v, d.latent, dtype=dtype, device=device, scale=d.latent**-0.5)
    scale = (d.nope + d.rope) ** -0.5
    for b in d.decode_batches:
        per_seq = -(-L // bs)
        cache = _rand(b * per_seq, bs, d.latent + d.rope, dtype=dtype, device=device)
        tables = torch.randperm(b * per_seq, device=device).view(b, per_seq)
        lens = torch.full((b,), L, device=device)
        q_nope = _rand(b, d.heads, d.nope, dtype=dtype, device=device)
        q_pe = _rand(b, d.heads, d.rope, dtype=dtype, device=device)
        args = (q_nope, q_pe, cache, tables, lens, w_uk, w_uv, scale)
        flops = 2 * b * d.heads * (d.nope * d.latent + L * (2 * d.latent + d.rope) + d.v * d.latent)
        yield Case("mla_decode", f"B={b} L={L} H={d.heads}", lambda a=args: mla_decode(*a),
                   lambda a=args: mla_decode_ref(*a),
                   b * L * (d.latent + d.rope) * it + d.heads * (d.nope + d.v) * d.latent * it, flops)


def fused_moe_cases(d: Dims, dtype: torch.dtype, device: str) -> Iterator[Case]:
    it, D, I, S = dtype.itemsize, d.hidden, d.inter, d.experts
    w13 = _rand(S, 2 * I, D, dtype=dtype, device=device, scale=D**-0.5)
    w2 = _rand(S, D, I, dtype=dtype, device=device, scale=I**-0.5)
    for t in d.moe_tokens:
        x = _rand(t, D, dtype=dtype, device=device)
        ids = torch.rand(t, S, device=device).topk(d.top_k, dim=1).indices
        w = torch.rand(t, d.top_k, device=device)
        pairs = t * d.top_k
        active = int(ids.unique().numel())
        moved = active * 3 * D * I * it + 2 * t * D * it + 2 * pairs * (I + D) * it
        yield Case("fused_moe", f"T={t} E={S} K={d.top_k} active={active}",
                   lambda x=x, i=ids, w=w: fused_moe(x, w13, w2, i, w),
                   lambda x=x, i=ids, w=w: fused_moe_ref(x, w13, w2, i, w), moved, 2 * pairs * 3 * D * I)


ALL = (rms_norm_cases, rotary_cases, kv_pack_cases, mla_decode_cases, fused_moe_cases)
