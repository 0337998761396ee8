"""Multi-head Latent Attention over a paged, compressed KV cache.

Shapes: T = tokens, H = attention heads, C = kv_lora_rank (latent), R = qk_rope_head_dim,
N = qk_nope_head_dim, V = v_head_dim, L = context length, B = decode sequences.

The cache keeps only [latent C | roped key R] per token and layer. Decode uses the
absorbed form: W_UK is folded into the query and W_UV applied after attention, so the
latent is never expanded. Extend sequences (prefill chunks, draft verification) expand
the latent to per-head K and V, which is cheaper when many queries share a context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.shared.kernels.mla_decode import mla_decode
from moemesh.shared.model.batch import ForwardBatch
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.layers import RMSNorm
from moemesh.shared.model.rope import RotaryEmbedding, softmax_scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.scale = softmax_scale(cfg)
        H, D = cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, D, bias=False)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, rope: RotaryEmbedding
    ) -> torch.Tensor:
        """x: [T, D]; kv_cache: this layer's [num_blocks, block_size, C + R]. Returns [T, D]."""
        T = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        flat_cache = kv_cache.view(-1, kv_cache.shape[-1])
        # q and k rotated, [latent | rotated k] into each token's cache slot: one kernel.
        q_pe = rope.with_cache(batch.positions, q_pe, latent, k_pe, batch.slot_mapping, flat_cache)  # [T, H, R]

        nd = batch.num_rowwise
        if nd and nd == T:  # a decode step: every row attended one by one, that output is the layer's
            return self.o_proj(self._decode(q_nope, q_pe, batch, kv_cache).reshape(T, self.num_heads * self.v_dim))
        out = x.new_empty(T, self.num_heads, self.v_dim)
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], batch, kv_cache)
        for ext in batch.extends:
            rows = slice(ext.q_start, ext.q_start + ext.q_len)
            ctx = flat_cache.index_select(0, ext.ctx_slots).to(x.dtype)
            out[rows] = self._extend(q_nope[rows], q_pe[rows], ctx, ext.ctx_len)
        return self.o_proj(out.view(T, self.num_heads * self.v_dim))

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, N, C], [H, V, C]

    def _decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        return mla_decode(
            q_nope, q_pe, kv_cache, batch.decode_block_tables, batch.decode_context_lens, *self._w_uk_uv(),
            self.scale,
        )

    def _extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, ctx_len: int) -> torch.Tensor:
        """q_*: [Q, H, *]; ctx: [L, C + R]. Causal: query i sits at position L - Q + i."""
        Q, L = q_nope.shape[0], ctx_len
        latent, k_pe = ctx.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(L, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(L, self.num_heads, self.rope_dim)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        mask = None
        if Q > 1:
            q_pos = torch.arange(L - Q, L, device=q.device)
            mask = torch.arange(L, device=q.device)[None, :] <= q_pos[:, None]  # [Q, L]
        # SDPA takes its fused (flash) kernel only for 4-D inputs with one head size for q,
        # k and v; otherwise it builds [H, Q, L] scores. On CPU at 2k queries x 8k keys the
        # fused kernel is 3x faster, and it spares the GBs of fresh temporaries that the
        # kernel would otherwise have to zero on every chunk.
        pad = q.shape[-1] - self.v_dim
        if pad > 0:
            v = F.pad(v, (0, pad))
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=self.scale
        )
        return o[0].transpose(0, 1)[..., : self.v_dim]  # [Q, H, V]

