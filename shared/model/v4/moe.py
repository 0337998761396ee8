"""DeepSeek-V4's MoE: every layer routes, the first ones by a frozen token-id hash.

E = routed experts, K = experts per token, T = tokens, D = hidden size.
- learned routing: top-k of score + e_score_correction_bias, score = sqrtsoftplus,
  sigmoid or softmax of the router logits;
- hash routing (`hash_moe` layers): the experts are tid2eid[token id], fixed at
  training; the learned scores still weight them;
- weights are the chosen scores, normalised (norm_topk_prob), times
  routed_scaling_factor;
- routed experts and the one shared expert clip their SwiGLU inputs (swiglu_limit).
Routed experts run through the same runner as V2/V3 (local fused kernel or expert
parallelism), so hash layers are balanced and counted like the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.shared.kernels.fused_moe import fused_moe
from moemesh.shared.kernels.route import route
from moemesh.shared.model.layers import MLP
from moemesh.shared.model.moe import Experts
from moemesh.shared.model.v4.config import V4Config


class V4Router(nn.Module):
    """Learned top-k; the weight is kept in fp32, as the router needs."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.top_k, self.scoring_func = cfg.num_experts_per_tok, cfg.scoring_func
        self.norm, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.choice_bias: torch.Tensor | None = None  # skew mode: bends the choice, never the weights

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, K] fp32, expert ids [T, K] int64): the GEMM, then one routing
        kernel on CUDA or its torch reference (shared/kernels/route.py)."""
        return self._route(F.linear(x.float(), self.weight.float()), input_ids)

    def _route(self, logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(logits, self.top_k, self.scoring_func, correction_bias=self.e_score_correction_bias,
                     choice_bias=self.choice_bias, norm=self.norm, scale=self.scale)


class HashRouter(V4Router):
    def __init__(self, cfg: V4Config):
        super().__init__(cfg)
        del self.e_score_correction_bias  # hash layers have none
        self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))

    def _route(self, logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(logits, self.top_k, self.scoring_func, norm=self.norm, scale=self.scale, tid2eid=self.tid2eid,
                     token_ids=input_ids)


class V4MoE(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int, num_slots: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.is_hash = cfg.is_hash_layer(layer_id)
        self.gate = HashRouter(cfg) if self.is_hash else V4Router(cfg)
        self.experts = Experts(num_slots or cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               cfg.swiglu_limit)
        # One shared expert of the routed width, as transformers builds it.
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)  # clipped as they are
        self.runner = None  # set by the engine for expert parallelism
        self.on_route = None  # load tracking hook

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        if self.on_route is not None:
            self.on_route(self.layer_id, ids)
        if self.runner is not None:
            out = self.runner(x, weights, ids)
        else:
            out = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, ids, weights,
                            self.experts.swiglu_limit)
        return out + self.shared_experts(x)
