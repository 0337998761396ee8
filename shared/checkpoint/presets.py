"""Architectures that `moemesh init-model` can write with random weights.

`tiny`, `tiny-v2` and `v4-tiny` are for tests. `bench` is sized so a batch-32 decode
step takes tens of milliseconds on two CPU cores. `v2-lite`, `v3` and `v4-flash` carry
the real published dimensions and are meant for GPU machines; tests never create them
(`--num-layers` trims them).
"""

from __future__ import annotations

import copy
from typing import Any

_V3_TOKENS = dict(bos_token_id=0, eos_token_id=1)

_TINY_V3: dict[str, Any] = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        original_max_position_embeddings=1024,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    rope_interleave=True,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    attention_bias=False,
    **_V3_TOKENS,
)

_TINY_V2: dict[str, Any] = dict(
    _TINY_V3,
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    q_lora_rank=None,
    topk_method="group_limited_greedy",
    scoring_func="softmax",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    num_nextn_predict_layers=0,
    rope_scaling=None,
)

_BENCH: dict[str, Any] = dict(
    _TINY_V3,
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=5,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    max_position_embeddings=32768,
    rope_scaling=dict(
        type="yarn", factor=8.0, original_max_position_embeddings=4096,
        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
    ),
)

_V2_LITE: dict[str, Any] = dict(
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
    scoring_func="softmax",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    hidden_act="silu",
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=dict(
        type="yarn", factor=40, original_max_position_embeddings=4096,
        beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
    ),
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
    # The special tokens sit at the front of the locally trained tokenizer.
    **_V3_TOKENS,
)

_V3: dict[str, Any] = dict(
    _TINY_V3,
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    max_position_embeddings=163840,
    rope_scaling=dict(
        type="yarn", factor=40, original_max_position_embeddings=4096,
        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
    ),
)

# DeepSeek-V4 for tests: every attention type (sliding, CSA with m=4, HCA with m'=16),
# two hash-routed layers, hyper-connections, an MTP layer. The window (8), HCA group (16)
# and index_topk (4) are small so that short prompts already pass the window, complete
# HCA groups and make the indexer choose; swiglu_limit is low enough to clip.
_TINY_V4: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=1024,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=0.25,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    sliding_window=8,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    index_n_heads=16,
    index_head_dim=16,
    index_topk=4,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=1.0,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=1024, beta_fast=32, beta_slow=1),
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    attention_bias=False,
    **_V3_TOKENS,
)

# The published DeepSeek-V4-Flash dimensions, in the upstream config's own spelling.
_V4_FLASH: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],  # 43 layers, then the MTP layer's
    compress_rope_theta=160000.0,
    num_hash_layers=3,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=6,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    hidden_act="silu",
    max_position_embeddings=1048576,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    **_V3_TOKENS,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY_V3,
    "tiny-v2": _TINY_V2,
    "bench": _BENCH,
    "v2-lite": _V2_LITE,
    "v3": _V3,
    "v4-tiny": _TINY_V4,
    "v4-flash": _V4_FLASH,
}

# The locally trained tokenizer is small (its corpus yields under a thousand tokens). For
# the test and CPU presets the model's vocabulary is cut to it, so that every token the
# model can sample has text; the real-dimension presets keep their published vocabulary
# (a padded embedding, as many real checkpoints have) since their cost depends on it.
TOKENIZER_VOCAB = {"tiny": 1024, "tiny-v2": 1024, "bench": 8192, "v2-lite": 8192, "v3": 8192, "v4-tiny": 1024,
                   "v4-flash": 8192}
VOCAB_FROM_TOKENIZER = ("tiny", "tiny-v2", "bench", "v4-tiny")
REAL_DIMENSIONS = ("v2-lite", "v3", "v4-flash")  # bfloat16 by default, for GPU machines


def preset_config(name: str, num_layers: int | None = None) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    cfg = copy.deepcopy(PRESETS[name])
    if num_layers is not None:
        if num_layers <= cfg.get("first_k_dense_replace", 0) or num_layers < 1:
            raise ValueError(f"--num-layers must exceed first_k_dense_replace={cfg.get('first_k_dense_replace', 0)}")
        if cfg["model_type"] == "deepseek_v4" and num_layers > cfg["num_hidden_layers"]:
            raise ValueError(f"--num-layers must be at most {cfg['num_hidden_layers']} for {name}")
        cfg["num_hidden_layers"] = num_layers
        for key in ("layer_types", "mlp_layer_types"):  # the per-layer lists are cut with it
            if key in cfg:
                cfg[key] = cfg[key][:num_layers]
        if "compress_ratios" in cfg:  # upstream's list ends with the MTP layer's (sliding) entry
            cfg["compress_ratios"] = cfg["compress_ratios"][:num_layers] + [0]
    return cfg
