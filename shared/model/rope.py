"""Rotary position embedding for the rope part of MLA's queries and keys, with YaRN.

DeepSeek lays rope dimensions out in interleaved pairs (x0, x1), (x2, x3), ...; with
`rope_interleave: false` the pairs are (x_i, x_{i+d/2}) instead. Either way the output
is written as [rotated firsts, rotated seconds]: queries and keys get the same
permutation, so attention scores are unchanged and the cache stays in one layout.
"""

from __future__ import annotations

import math

import torch

from moemesh.shared.kernels.rotary import rope_cache
from moemesh.shared.model.config import ModelConfig, RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    # On the CPU even where the model is built on the meta device (checkpoint/loader.py):
    # a computed table is no weight, and arithmetic on meta tensors imports torch._dynamo.
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def softmax_scale(cfg: ModelConfig) -> float:
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope.kind != "default" and cfg.rope.mscale_all_dim:
        m = _yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin tables for every position up to the model's context length."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.interleave = cfg.rope_interleave
        dim = cfg.qk_rope_head_dim
        inv_freq, attn_factor = inv_freq_and_attention_factor(cfg.rope, dim)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * inv_freq[None, :]  # [P, dim/2]
        self.register_buffer("cos", freqs.cos() * attn_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attn_factor, persistent=False)

    def with_cache(self, positions: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, k: torch.Tensor,
                   slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """Rotates q [T, H, dim] and k [T, dim], writes [latent | rotated k] into cache rows
        `slots`; returns the rotated q (shared/kernels/rotary.py: rope_cache)."""
        return rope_cache(q, latent, k, self.cos, self.sin, positions, slots, cache, self.interleave)
