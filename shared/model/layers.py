"""Small building blocks shared by the target model and the MTP head."""

from __future__ import annotations

import torch
from torch import nn

from moemesh.shared.kernels.rmsnorm import rms_norm
from moemesh.shared.kernels.swiglu import swiglu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, fp32_weight: bool = False):
        """fp32_weight: DeepSeek-V4's norm, whose weight is held in fp32 and multiplies
        before the one rounding to x's dtype; else V2/V3's, whose weight is held in the
        model's dtype and multiplies the rounded value (shared/kernels/rmsnorm.py)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32 if fp32_weight else None))
        self.eps, self.fp32_weight = eps, fp32_weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x); or, given the residual stream, (rmsnorm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual, self.fp32_weight)


class FusedLinears:
    """Linears that read the same input, as one GEMM: their weights become rows of one
    [sum of outputs, in] tensor, each linear's weight a view of its rows, so that the
    checkpoint loads into it through the linears' own names. One launch where there
    were as many as linears (and a cat where their outputs were joined)."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        self.sizes = [lin.out_features for lin in linears]
        o = 0
        for lin, n in zip(linears, self.sizes):
            lin.weight = nn.Parameter(self.weight[o : o + n], requires_grad=False)
            o += n

    @property
    def intact(self) -> bool:
        """Whether each linear still reads its rows (nothing moved or replaced them)."""
        ptr, step = self.weight.data_ptr(), self.weight.stride(0) * self.weight.element_size()
        o = 0
        for lin, n in zip(self.linears, self.sizes):
            if lin.weight.data_ptr() != ptr + o * step:
                return False
            o += n
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., sum of outputs]: each linear's output a column slice."""
        return torch.nn.functional.linear(x, self.weight)


class MLP(nn.Module):
    """SwiGLU FFN, used for dense layers and shared experts (Hugging Face names). limit:
    DeepSeek-V4's clipping before the activation (its shared experts), None for none."""

    def __init__(self, hidden: int, intermediate: int, limit: float | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.limit = limit
        self.gate_up: FusedLinears | None = None  # fuse(): gate and up in one GEMM

    def fuse(self) -> None:
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:  # the halves of one GEMM's output
            y, n = self.gate_up(x), self.gate_proj.out_features
            gate, up = y[..., :n], y[..., n:]
        return self.down_proj(swiglu(gate, up, self.limit))


def unfuse_moved(model: nn.Module) -> None:
    """Drop every fusion whose linears no longer read its rows (a weight replaced after
    the fusion was made): those linears run one by one, as they are."""
    for m in model.modules():
        for name, part in list(vars(m).items()):
            if isinstance(part, FusedLinears) and not part.intact:
                setattr(m, name, None)
