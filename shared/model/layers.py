"""Small building blocks shared by the target model and the MTP head."""

from __future__ import annotations

import torch
from torch import nn

from moemesh.shared.kernels.rmsnorm import rms_norm
from moemesh.shared.kernels.swiglu import swiglu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x); or, given the residual stream, (rmsnorm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual)


class MLP(nn.Module):
    """SwiGLU FFN, used for dense layers and shared experts (Hugging Face names)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
