"""What one token costs in a DeepSeek model: weight bytes, FLOPs and KV reads per layer.

Built from a checkpoint's config.json (V2/V3 with MLA, V4 with compressed attention),
so the planner sees the same model the engine serves. The numbers are analytic, from the
layer shapes; nothing here is measured.

Glossary:
- dense part: everything a rank runs for its own tokens (attention, shared experts, the
  dense MLP layers, LM head). Under DEP it is data-parallel: each rank holds a copy.
- routed expert: one of E experts of a MoE layer, spread over the ranks.
- pair: one (token, expert) choice; a token makes top_k of them per MoE layer.
- context position / entry: a KV row a query reads (V4 reads compressed entries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ModelDims:
    """Sizes the step model needs; see from_config.

    Args:
        name: for tables.
        family: "mla" (V2/V3) or "v4".
        hidden: D.
        num_layers: target layers (MTP excluded).
        num_moe_layers: layers with routed experts.
        num_experts: E routed experts per MoE layer.
        top_k: routed experts per token.
        expert_params: parameters of one routed expert (gate, up, down).
        dense_params: parameters every rank reads per step for its own tokens (attention,
            shared experts, dense MLPs, LM head), all layers.
        attn_flops_per_ctx: FLOPs per query token per context position per layer in
            decode (V4: per attended entry).
        prefill_flops_per_pair: FLOPs per (query, key) pair per layer in prefill.
        kv_bytes_per_ctx: KV bytes read per context position per layer (V4: per entry).
        expert_weight_bytes, dense_weight_bytes: bytes per parameter as served.
        sliding_window, csa_rate, csa_topk, hca_rate, num_csa_layers, num_hca_layers,
        index_dim, index_heads: V4's compressed attention (zero for MLA).
    """

    name: str
    family: str
    hidden: int
    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_params: int
    dense_params: int
    attn_flops_per_ctx: float
    prefill_flops_per_pair: float
    kv_bytes_per_ctx: float
    expert_weight_bytes: float = 1.0
    dense_weight_bytes: float = 1.0
    sliding_window: int = 0
    csa_rate: int = 0
    csa_topk: int = 0
    hca_rate: int = 0
    num_csa_layers: int = 0
    num_hca_layers: int = 0
    index_dim: int = 0
    index_heads: int = 0

    def __post_init__(self) -> None:
        if self.family not in ("mla", "v4"):
            raise ValueError(f"unknown attention family {self.family!r}")
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts or self.num_moe_layers < 1:
            raise ValueError("a MoE model needs experts, top_k in [1, E] and at least one MoE layer")

    @property
    def expert_bytes(self) -> float:
        return self.expert_params * self.expert_weight_bytes

    @property
    def expert_flops_per_pair(self) -> float:
        return 2.0 * self.expert_params

    def entries(self, ctx):
        """Context entries one decode query reads, summed over layers (ctx: float or array)."""
        if self.family == "mla":
            return ctx * self.num_layers
        win = np.minimum(ctx, self.sliding_window) * self.num_layers
        csa = np.minimum(ctx / self.csa_rate, self.csa_topk) * self.num_csa_layers if self.csa_rate else 0.0
        hca = ctx / self.hca_rate * self.num_hca_layers if self.hca_rate else 0.0
        return win + csa + hca

    def kv_stored_bytes(self, ctx):
        """KV cache one sequence of context ctx holds, all layers."""
        if self.family == "mla":
            return ctx * self.num_layers * self.kv_bytes_per_ctx
        rows = np.minimum(ctx, self.sliding_window) * self.num_layers
        if self.csa_rate:
            rows = rows + ctx / self.csa_rate * self.num_csa_layers
        if self.hca_rate:
            rows = rows + ctx / self.hca_rate * self.num_hca_layers
        index = ctx / self.csa_rate * self.num_csa_layers * self.index_dim if self.csa_rate else 0.0
        return rows * self.kv_bytes_per_ctx + index

    def weight_bytes(self, experts_per_layer: float) -> float:
        """Weights one rank holds: the data-parallel part and its expert slots."""
        return self.dense_params * self.dense_weight_bytes + experts_per_layer * self.num_moe_layers * self.expert_bytes

    def decode_attn(self, ctx):
        """(FLOPs, bytes) of one decode query's attention core at context ctx, all layers.
        V4 adds the CSA indexer, which scores every compressed entry (not just the top-k)."""
        flops = self.entries(ctx) * self.attn_flops_per_ctx
        nbytes = self.entries(ctx) * self.kv_bytes_per_ctx
        if self.family == "v4" and self.csa_rate:
            scanned = ctx / self.csa_rate * self.num_csa_layers
            flops += scanned * 2 * self.index_heads * self.index_dim
            nbytes += scanned * self.index_dim  # fp8 index keys
        return flops, nbytes

    def prefill_attn_flops(self, new, prefix):
        """Attention-core FLOPs of prefilling `new` tokens after `prefix` cached ones (causal)."""
        if self.family == "mla":
            pairs = new * (prefix + new / 2)
            return pairs * self.prefill_flops_per_pair * self.num_layers
        # V4: a query reads the window, the CSA top-k and every HCA entry, and the indexer
        # scores every CSA entry: linear in the context, with a small quadratic part.
        mid = prefix + new / 2
        return new * (self.decode_attn(mid)[0])


def _g(raw: dict[str, Any], key: str, default: Any = None) -> Any:
    v = raw.get(key, default)
    if v is None:
        raise ValueError(f"config.json has no {key!r}")
    return v


def from_config(raw: dict[str, Any], name: str = "model", *, expert_weight_bytes: float | None = None,
                dense_weight_bytes: float = 1.0, kv_bytes: float | None = None) -> ModelDims:
    """ModelDims from a config.json dict (Hugging Face or DeepSeek upstream spelling).

    Args:
        expert_weight_bytes: bytes per routed-expert parameter; default 0.5 for V4 (its
            experts ship in FP4) and 1.0 for V3 (FP8), as the checkpoints are released.
        dense_weight_bytes: bytes per other parameter (FP8: 1.0).
        kv_bytes: bytes per cached value; default 2 (bf16) for MLA, 1 (fp8) for V4.
    """
    mt = raw.get("model_type")
    hidden, vocab = int(_g(raw, "hidden_size")), int(_g(raw, "vocab_size"))
    layers = int(_g(raw, "num_hidden_layers"))
    experts, top_k = int(_g(raw, "n_routed_experts")), int(_g(raw, "num_experts_per_tok"))
    inter = int(_g(raw, "moe_intermediate_size"))
    shared = int(raw.get("n_shared_experts") or 0)
    expert_params = 3 * hidden * inter
    lm_head = hidden * vocab
    if mt == "deepseek_v4":
        return _v4(raw, name, hidden, layers, experts, top_k, expert_params, shared, lm_head,
                   0.5 if expert_weight_bytes is None else expert_weight_bytes, dense_weight_bytes,
                   1.0 if kv_bytes is None else kv_bytes)
    if mt not in ("deepseek_v2", "deepseek_v3"):
        raise ValueError(f"unsupported model_type {mt!r}: the planner knows deepseek_v2/v3/v4")
    heads = int(_g(raw, "num_attention_heads"))
    q_lora = raw.get("q_lora_rank")
    kv_lora, rope = int(_g(raw, "kv_lora_rank")), int(_g(raw, "qk_rope_head_dim"))
    nope, v = int(_g(raw, "qk_nope_head_dim")), int(_g(raw, "v_head_dim"))
    q_out = heads * (nope + rope)
    q = hidden * q_lora + q_lora * q_out if q_lora else hidden * q_out
    attn = q + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * hidden
    dense_k = int(raw.get("first_k_dense_replace") or 0)
    moe_layers = layers - dense_k
    dense_mlp = 3 * hidden * int(_g(raw, "intermediate_size"))
    dense = layers * attn + dense_k * dense_mlp + moe_layers * shared * expert_params + lm_head
    kvb = 2.0 if kv_bytes is None else kv_bytes
    return ModelDims(
        name=name, family="mla", hidden=hidden, num_layers=layers, num_moe_layers=moe_layers,
        num_experts=experts, top_k=top_k, expert_params=expert_params, dense_params=dense,
        # Decode runs MLA absorbed: scores over the latent and rope key, values over the latent.
        attn_flops_per_ctx=2.0 * heads * (2 * kv_lora + rope),
        # Prefill runs it expanded: per head a qk dot of nope+rope and a v row.
        prefill_flops_per_pair=2.0 * heads * (nope + rope + v),
        kv_bytes_per_ctx=(kv_lora + rope) * kvb,
        expert_weight_bytes=1.0 if expert_weight_bytes is None else expert_weight_bytes,
        dense_weight_bytes=dense_weight_bytes)


def _v4(raw, name, hidden, layers, experts, top_k, expert_params, shared, lm_head, ewb, dwb, kvb) -> ModelDims:
    heads, head_dim = int(_g(raw, "num_attention_heads")), int(_g(raw, "head_dim"))
    q_lora = int(_g(raw, "q_lora_rank"))
    o_groups, o_lora = int(_g(raw, "o_groups")), int(_g(raw, "o_lora_rank"))
    idx_heads, idx_dim = int(raw.get("index_n_heads") or 0), int(raw.get("index_head_dim") or 0)
    rates = _v4_rates(raw, layers)
    used = sorted({m for m in rates if m})  # CSA compresses less than HCA
    csa_rate = used[0] if used else 0
    hca_rate = used[-1] if len(used) > 1 else 0
    n_csa = sum(1 for m in rates if m and m == csa_rate)
    n_hca = sum(1 for m in rates if hca_rate and m == hca_rate)
    rope = int(raw.get("qk_rope_head_dim") or head_dim * float(raw.get("partial_rotary_factor", 0.125)))
    attn = (hidden * q_lora + q_lora * heads * head_dim + hidden * head_dim
            + heads * head_dim * o_lora + o_groups * o_lora * hidden)
    indexer = q_lora * idx_heads * idx_dim + hidden * idx_dim + hidden * idx_heads
    compressor = 2 * hidden * head_dim
    dense = (layers * attn + n_csa * (indexer + compressor) + n_hca * compressor
             + layers * shared * expert_params + lm_head)
    return ModelDims(
        name=name, family="v4", hidden=hidden, num_layers=layers, num_moe_layers=layers,
        num_experts=experts, top_k=top_k, expert_params=expert_params, dense_params=dense,
        # One KV head (MQA) of head_dim: per entry and head a score and a value row.
        attn_flops_per_ctx=4.0 * heads * head_dim, prefill_flops_per_pair=4.0 * heads * head_dim,
        # fp8 for the non-rope part, bf16 for the rope part: head_dim + rope bytes at kvb = 1.
        kv_bytes_per_ctx=(head_dim + rope) * kvb,
        expert_weight_bytes=ewb, dense_weight_bytes=dwb, sliding_window=int(raw.get("sliding_window") or 0),
        csa_rate=csa_rate, csa_topk=int(raw.get("index_topk") or 0), hca_rate=hca_rate, num_csa_layers=n_csa,
        num_hca_layers=n_hca, index_dim=idx_dim, index_heads=idx_heads)


def _v4_rates(raw: dict[str, Any], layers: int) -> list[int]:
    """Compression rate of each target layer (0 = sliding window only), either spelling."""
    if "compress_ratios" in raw:
        return [int(m) for m in raw["compress_ratios"][:layers]]
    rates = raw.get("compress_rates") or {}
    return [int(rates.get(t, 0)) for t in _g(raw, "layer_types")[:layers]]
