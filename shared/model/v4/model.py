"""DeepSeek-V4 causal LM with its MTP draft head, over the hybrid paged cache.

Module and parameter names follow the checkpoints transformers writes (`model.layers.
{i}.self_attn...`, `attn_hc`, `ffn_hc`, `model.hc_head`); routed experts are stacked.
The MTP layer lives under `mtp.0` with the upstream names of its own parts (`e_proj`,
`h_proj`, `enorm`, `hnorm`, `norm`, `hc_head`); it shares the target's embedding and LM
head, and attends over the sliding window only.

The residual stream is hc_mult streams wide, so `forward` returns it flattened
[T, hc*D]: the LM head collapses it (hc_head, norm) and the MTP layer starts from it.

What the reference keeps in fp32 stays fp32 in any serving dtype: the hyper-connections,
the routers, the sinks, the compressors' position biases, and every norm's weight
(V4's norms multiply by it in fp32 and round once; shared/kernels/rmsnorm.py).
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.shared.model.batch import ForwardBatch
from moemesh.shared.model.layers import MLP, RMSNorm
from moemesh.shared.model.v4.attention import V4Attention, V4Step
from moemesh.shared.model.v4.config import V4Config
from moemesh.shared.model.v4.hyper import HyperConnection, HyperHead, merge
from moemesh.shared.model.v4.layout import V4Layout
from moemesh.shared.model.v4.moe import V4MoE
from moemesh.shared.model.v4.rope import Rope


class V4Block(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int, num_slots: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = V4Attention(cfg, layer_id)
        self.mlp = V4MoE(cfg, layer_id, num_slots)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp32_weight=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp32_weight=True)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, st: V4Step, layout: V4Layout) -> torch.Tensor:
        """h: [T, N, D] streams."""
        post, comb, x = self.attn_hc(h)
        h = merge(h, self.self_attn(self.input_layernorm(x), st, layout.layers[self.layer_id]), post, comb)
        post, comb, x = self.ffn_hc(h)
        return merge(h, self.mlp(self.post_attention_layernorm(x), input_ids), post, comb)


class V4Model(nn.Module):
    def __init__(self, cfg: V4Config, num_slots: int | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4Block(cfg, i, num_slots) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp32_weight=True)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)


class V4MTPLayer(V4Block):
    """From (embedding of token i+1, the target's streams at i) it predicts token i+2."""

    def __init__(self, cfg: V4Config, layer_id: int, num_slots: int | None = None):
        super().__init__(cfg, layer_id, num_slots)
        D = cfg.hidden_size
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, fp32_weight=True)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, fp32_weight=True)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, fp32_weight=True)
        self.hc_head = HyperHead(cfg.hc_mult, D, cfg.hc_eps, cfg.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg: V4Config, num_slots: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = V4Model(cfg, num_slots)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(
            V4MTPLayer(cfg, cfg.num_hidden_layers + j, num_slots) for j in range(cfg.num_nextn_predict_layers))
        self.ropes = nn.ModuleDict({"main": Rope(cfg.rope_main, cfg.qk_rope_head_dim),
                                    "compress": Rope(cfg.rope_compress, cfg.qk_rope_head_dim)})
        self.layout: V4Layout | None = None  # set with the cache (it depends on the block size)

    def fuse_projections(self) -> None:
        """Each attention's projections of its input as one GEMM (V4Attention.fuse), and
        each shared expert's gate and up. Call before the weights load: they load into
        the fused tensors through the views."""
        for m in self.modules():
            if isinstance(m, (V4Attention, MLP)):
                m.fuse()

    def moe_layers(self) -> dict[int, V4MoE]:
        out = {i: layer.mlp for i, layer in enumerate(self.model.layers)}
        for m in self.mtp:
            out[m.mlp.layer_id] = m.mlp
        return out

    def _step(self, batch: ForwardBatch, cache) -> V4Step:
        angles = {k: r.angles(batch.positions) for k, r in self.ropes.items()}
        return V4Step(cache.main, cache.rings, batch.hybrid, angles, dict(self.ropes))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache) -> torch.Tensor:
        """cache: the engine's HybridKVCache. Returns the streams [T, hc*D]."""
        st = self._step(batch, cache)
        x = self.model.embed_tokens(batch.input_ids)
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            h = layer(h, batch.input_ids, st, cache.layout)
        return h.flatten(1)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(self.model.hc_head(self._streams(hidden)))).float()

    def _streams(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(flat.shape[0], self.cfg.hc_mult, self.cfg.hidden_size)

    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, cache) -> torch.Tensor:
        """batch.input_ids hold token i+1 for each position i; prev_hidden [T, hc*D] are the
        target's streams at i, or the previous draft step's. Returns the MTP streams."""
        m = self.mtp[0]
        st = self._step(batch, cache)
        e = m.enorm(self.model.embed_tokens(batch.input_ids))
        h = m.hnorm(self._streams(prev_hidden))
        h = m.e_proj(e).unsqueeze(1) + m.h_proj(h)
        return m(h, batch.input_ids, st, cache.layout).flatten(1)

    @torch.inference_mode()
    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        m = self.mtp[0]
        return self.lm_head(m.norm(m.hc_head(self._streams(hidden)))).float()
