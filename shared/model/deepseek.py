"""DeepSeek-V2/V3 causal LM with its MTP draft head, over a paged latent cache.

Module and parameter names follow the Hugging Face checkpoints, except that the MTP
layer (`model.layers.{num_hidden_layers}` on disk) lives under `mtp.0` here and routed
experts are held stacked (`mlp.experts.gate_up_proj` / `down_proj`).
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.shared.model.batch import ForwardBatch
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.layers import MLP, RMSNorm
from moemesh.shared.model.mla import MLAttention
from moemesh.shared.model.moe import MoE
from moemesh.shared.model.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, moe: bool, num_slots: int | None = None):
        super().__init__()
        self.self_attn = MLAttention(cfg)
        self.mlp: nn.Module = MoE(cfg, layer_id, num_slots) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, rope: RotaryEmbedding
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), batch, kv_cache, rope)
        h, x = self.post_attention_layernorm(h, residual=x)  # the residual add rides in the norm kernel
        return x + self.mlp(h)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """One multi-token-prediction module: from (embedding of token i+1, hidden state at i)
    it predicts token i+2, with a decoder block and an MoE of its own."""

    def __init__(self, cfg: ModelConfig, layer_id: int, num_slots: int | None = None):
        super().__init__(cfg, layer_id, moe=cfg.n_routed_experts > 0, num_slots=num_slots)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, num_slots: int | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, moe=cfg.is_moe_layer(i), num_slots=num_slots) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, num_slots: int | None = None):
        """num_slots: routed-expert slots per MoE layer held here (expert parallelism);
        None holds every expert."""
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekModel(cfg, num_slots)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(
            MTPLayer(cfg, cfg.num_hidden_layers + j, num_slots) for j in range(cfg.num_nextn_predict_layers))
        self.rope = RotaryEmbedding(cfg)

    def fuse_projections(self) -> None:
        """Each MLP's (dense, shared expert) gate and up as one GEMM. Call before the
        weights load: they load into the fused tensors through the views."""
        for m in self.modules():
            if isinstance(m, MLP):
                m.fuse()

    def moe_layers(self) -> dict[int, MoE]:
        """MoE modules by layer id; the MTP layer's id is num_hidden_layers."""
        out = {i: layer.mlp for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, MoE)}
        for m in self.mtp:
            if isinstance(m.mlp, MoE):
                out[m.mlp.layer_id] = m.mlp
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor) -> torch.Tensor:
        """Runs the target layers. kv_caches: [num_cache_layers, blocks, block_size, C+R].
        Returns the final-normed hidden states [T, D]."""
        x = self.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, batch, kv_caches[i], self.rope)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, kv_caches: torch.Tensor) -> torch.Tensor:
        """batch.input_ids hold token i+1 for each position i; prev_hidden [T, D] is the
        target's final-normed hidden state at i, or the previous draft step's output when
        drafts are chained. Returns the MTP block's output, before the shared-head norm."""
        m = self.mtp[0]
        e = m.enorm(m.embed_tokens(batch.input_ids))
        x = m.eh_proj(torch.cat([e, m.hnorm(prev_hidden)], dim=-1))
        return DecoderLayer.forward(m, x, batch, kv_caches[self.cfg.num_hidden_layers], self.rope)

    @torch.inference_mode()
    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.mtp[0].shared_head
        return head.head(head.norm(hidden)).float()
