"""V4's rotary embedding: interleaved pairs on the trailing `rope_dim` channels of a head.

Two tables, as in the checkpoint's config: "main" (plain, sliding-only layers) and
"compress" (CSA/HCA layers, their compressors and the indexer; YaRN when configured).
Unlike the MLA path, the layout is kept as it is: keys double as values here, and the
attention output is rotated back by the query's angle (`inverse`), so a permuted
layout would leak into the output projection.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.shared.model.config import RopeConfig
from moemesh.shared.model.rope import inv_freq_and_attention_factor


class Rope(nn.Module):
    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        inv_freq, self.attention_factor = inv_freq_and_attention_factor(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim/2] in fp32."""
        freqs = positions[:, None].float() * self.inv_freq[None, :].to(positions.device)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., D]: rotate its last 2 * cos.shape[-1] channels by the row's angles
    (cos/sin [T, R/2]); the leading channels pass through. Angles are rounded to x's
    dtype first and the rotation runs in fp32, as the reference does."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c = cos.to(x.dtype).float().view(shape)
    s = sin.to(x.dtype).float().view(shape)
    if inverse:
        s = -s
    rope = x[..., -2 * half :].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., : -2 * half], out], dim=-1)
