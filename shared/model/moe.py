"""DeepSeekMoE: a router over routed experts, plus always-on shared experts.

E = routed experts, K = experts per token, T = tokens, D = hidden size.
The router always runs in fp32, as the checkpoints keep its weight and bias in fp32.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.shared.kernels.fused_moe import fused_moe
from moemesh.shared.kernels.route import route
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.layers import MLP


def select_experts(
    logits: torch.Tensor,  # [T, E] fp32
    *,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None = None,
    choice_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights [T, K] fp32, expert ids [T, K] int64).

    `choice_bias` only shifts which experts win, never the weights; it is how the skew
    mode bends routing on purpose without changing the model's arithmetic.
    """
    # One implementation for every model (shared/kernels/route.py): the kernel on CUDA
    # tensors, its torch reference, which is this function's arithmetic, elsewhere.
    grouped = topk_method in ("noaux_tc", "group_limited_greedy") and n_group > 1
    return route(logits, top_k, scoring_func, correction_bias=correction_bias, choice_bias=choice_bias,
                 n_group=n_group if grouped else 1, topk_group=topk_group,
                 group_score="top2" if topk_method == "noaux_tc" else "max", norm=norm_topk_prob,
                 scale=routed_scaling_factor, scale_after_norm=scoring_func == "sigmoid")


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        if cfg.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self._kw = dict(
            top_k=cfg.num_experts_per_tok,
            scoring_func=cfg.scoring_func,
            topk_method=cfg.topk_method,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        self.choice_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        return select_experts(
            logits, correction_bias=self.e_score_correction_bias, choice_bias=self.choice_bias, **self._kw
        )


class Experts(nn.Module):
    """Routed expert weights stacked per slot (the fused Hugging Face layout)."""

    def __init__(self, num_slots: int, hidden: int, intermediate: int, swiglu_limit: float | None = None):
        super().__init__()
        self.swiglu_limit = swiglu_limit  # DeepSeek-V4 clips the SwiGLU inputs; V2/V3 do not
        self.gate_up_proj = nn.Parameter(torch.empty(num_slots, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_slots, hidden, intermediate))


# Signature of whatever computes routed experts for a layer: the local reference, a
# Triton kernel, or an expert-parallel dispatcher. (x, weights, logical ids) -> [T, D]
ExpertRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, num_slots: int | None = None):
        """num_slots: expert slots held by this process; all experts unless expert-parallel."""
        super().__init__()
        self.layer_id = layer_id
        self.gate = Router(cfg)
        self.experts = Experts(num_slots or cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        self.runner: ExpertRunner | None = None  # set by the engine for expert parallelism
        self.on_route: Callable[[int, torch.Tensor], None] | None = None  # load tracking hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.on_route is not None:
            self.on_route(self.layer_id, ids)
        if self.runner is not None:
            out = self.runner(x, weights, ids)
        else:
            out = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, ids, weights,
                            self.experts.swiglu_limit)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
