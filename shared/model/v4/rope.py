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
from moemesh.shared.kernels.v4_rope import rope
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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
           rms_eps: float | None = None) -> torch.Tensor:
    """x [T, ..., D]: rotate its last 2 * cos.shape[-1] channels by the row's angles
    (cos/sin [T, R/2]); the leading channels pass through. rms_eps: RMS-normalise each
    head first (no weight). Angles are rounded to x's dtype first and the rotation runs
    in fp32, as the reference does (shared/kernels/v4_rope.py: one kernel, or torch)."""
    return rope(x, cos, sin, inverse, rms_eps)
