"""DeepSeek-V4's architecture, parsed from a Hugging Face `config.json`.

Both spellings found in the wild are read, and give the same result:
- the current one (`layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters`
  with "main" and "compress" entries, `partial_rotary_factor`);
- the upstream one (`compress_ratios` per layer, `compress_rate_csa`/`_hca`,
  `num_hash_layers`, `qk_rope_head_dim`, a flat `rope_scaling`).

Glossary: CSA = compressed sparse attention (every `m` tokens pool into one entry, an
indexer picks the top-k entries per query); HCA = heavily compressed attention (every
`m'` tokens pool into one entry, all of them visible); sliding = the window branch only.
Every layer has the sliding-window branch; CSA and HCA layers add compressed entries.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from moemesh.shared.model.config_fields import ConfigError, Getter, RopeConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass(frozen=True)
class V4Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]  # ((CSA, m), (HCA, m')), hashable
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float | None
    rms_norm_eps: float
    max_position_embeddings: int
    rope_main: RopeConfig
    rope_compress: RopeConfig
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- what the engine, loader and balancer ask of any model config -------------
    @property
    def intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def num_cache_layers(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0  # every V4 layer's FFN is an MoE

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def identity(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("raw", None)
        return d

    # ---- V4 specifics -----------------------------------------------------------------
    def rate(self, layer_type: str) -> int:
        return dict(self.compress_rates)[layer_type]

    def layer_type(self, layer_idx: int) -> str:
        """The MTP layers (ids >= num_hidden_layers) attend over the sliding window only."""
        return self.layer_types[layer_idx] if layer_idx < self.num_hidden_layers else SLIDING

    def compress_rate(self, layer_idx: int) -> int:
        t = self.layer_type(layer_idx)
        return 0 if t == SLIDING else self.rate(t)

    def is_hash_layer(self, layer_idx: int) -> bool:
        return layer_idx < self.num_hidden_layers and self.mlp_layer_types[layer_idx] == HASH_MOE

    @property
    def used_rates(self) -> tuple[int, ...]:
        """The compress rates some layer uses, ascending."""
        return tuple(sorted({self.compress_rate(i) for i in range(self.num_cache_layers)} - {0}))

    @property
    def block_multiple(self) -> int:
        """A KV block must hold whole compression groups: its size is a multiple of this."""
        return math.lcm(1, *self.used_rates)

    @property
    def lookback(self) -> int:
        """How many earlier positions a step may read besides the compressed entries: the
        window's W-1, a CSA group and the one before it (2m-1), an HCA group (m'-1)."""
        need = [self.sliding_window - 1]
        for i in range(self.num_cache_layers):
            m = self.compress_rate(i)
            if m:
                need.append((2 * m if self.layer_type(i) == CSA else m) - 1)
        return max(need)

    # ---- parsing ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "V4Config":
        g = Getter(raw, source)

        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        n = g.int("num_hidden_layers")
        head_dim = g.int("head_dim", 512)
        rates = {CSA: 4, HCA: 128}
        if raw.get("compress_rates") is not None:
            if not isinstance(raw["compress_rates"], dict):
                raise bad("compress_rates must be an object {layer type: rate}")
            rates.update(raw["compress_rates"])
        for key, t in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if raw.get(key) is not None:
                rates[t] = raw[key]
        for t, m in rates.items():
            if t not in (CSA, HCA) or isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise bad(f"compress_rates[{t!r}] must be a positive integer, got {m!r}")

        layer_types, types_key = raw.get("layer_types"), "layer_types"
        if layer_types is None and raw.get("compress_ratios") is not None:
            if rates[CSA] == rates[HCA]:
                raise bad(f"compress_ratios cannot tell CSA from HCA layers: both rates are {rates[CSA]}")
            by_rate = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
            ratios, types_key = raw["compress_ratios"], "compress_ratios"
            if not isinstance(ratios, list) or any(r not in by_rate for r in ratios):
                raise bad(f"compress_ratios must list 0 (sliding), {rates[CSA]} (CSA) or {rates[HCA]} (HCA) "
                          f"per layer, got {ratios!r}")
            layer_types = [by_rate[r] for r in ratios]
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        layer_types = _list_of(layer_types, "layer_types", LAYER_TYPES, source)
        if len(layer_types) < n:
            raise bad(f"{types_key} has {len(layer_types)} entries for {n} layers")
        layer_types = layer_types[:n]  # the upstream list carries the MTP layer's entry too

        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = g.int("num_hash_layers", 3)
            mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        mlp_types = _list_of(mlp_types, "mlp_layer_types", (HASH_MOE, MOE), source)
        if len(mlp_types) < n:
            raise bad(f"mlp_layer_types has {len(mlp_types)} entries for {n} layers")
        mlp_types = mlp_types[:n]

        prf = raw.get("partial_rotary_factor")
        if prf is None:
            rope_dim = g.int("qk_rope_head_dim", 64) if "qk_rope_head_dim" in raw else head_dim * 64 // 512
        else:
            rope_dim = int(head_dim * float(prf))
        rope_main, rope_compress = _parse_v4_rope(raw, source)

        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        limit = raw.get("swiglu_limit", 10.0)
        cfg = cls(
            model_type="deepseek_v4",
            vocab_size=g.int("vocab_size"),
            hidden_size=g.int("hidden_size"),
            moe_intermediate_size=g.int("moe_intermediate_size", raw.get("intermediate_size")),
            num_hidden_layers=n,
            num_attention_heads=g.int("num_attention_heads"),
            head_dim=head_dim,
            q_lora_rank=g.int("q_lora_rank"),
            qk_rope_head_dim=rope_dim,
            o_groups=g.int("o_groups", 8),
            o_lora_rank=g.int("o_lora_rank"),
            sliding_window=g.int("sliding_window", 128),
            layer_types=tuple(layer_types),
            compress_rates=((CSA, rates[CSA]), (HCA, rates[HCA])),
            index_n_heads=g.int("index_n_heads", 64),
            index_head_dim=g.int("index_head_dim", 128),
            index_topk=g.int("index_topk", 512),
            hc_mult=g.int("hc_mult", 4),
            hc_sinkhorn_iters=g.int("hc_sinkhorn_iters", 20),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            mlp_layer_types=tuple(mlp_types),
            n_routed_experts=g.int("n_routed_experts"),
            n_shared_experts=g.int("n_shared_experts", 1),
            num_experts_per_tok=g.int("num_experts_per_tok"),
            scoring_func=raw.get("scoring_func") or "sqrtsoftplus",
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
            swiglu_limit=None if limit is None else float(limit),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=g.int("max_position_embeddings", 1 << 20),
            rope_main=rope_main,
            rope_compress=rope_compress,
            num_nextn_predict_layers=g.int("num_nextn_predict_layers", 0),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id", 0),
            eos_token_ids=eos_ids,
            raw=raw,
        )
        cfg._validate(bad)
        return cfg

    def _validate(self, bad) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise bad(f"scoring_func {self.scoring_func!r} is not supported ({', '.join(SCORING_FUNCS)})")
        if self.n_routed_experts < 1 or not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise bad(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, n_routed_experts="
                      f"{self.n_routed_experts}]")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            raise bad(f"the rotary part ({self.qk_rope_head_dim} of head_dim {self.head_dim}) must be even "
                      f"and fit the head")
        if self.num_attention_heads % self.o_groups:
            raise bad(f"num_attention_heads={self.num_attention_heads} is not divisible by o_groups={self.o_groups}")
        if self.sliding_window < 1:
            raise bad("sliding_window must be >= 1")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise bad("hc_mult and hc_sinkhorn_iters must be >= 1")
        if self.num_nextn_predict_layers > 1:
            raise bad("only one MTP layer (num_nextn_predict_layers <= 1) is supported")
        for r in (self.rope_main, self.rope_compress):
            if r.kind not in ("default", "yarn"):
                raise bad(f"rope type {r.kind!r} is not supported (default or yarn)")


def _list_of(v: Any, key: str, allowed: tuple[str, ...], source: str) -> list[str]:
    if not isinstance(v, list) or any(x not in allowed for x in v):
        raise ConfigError(f"{source}: {key} must be a list of {', '.join(allowed)}; got {v!r}")
    return list(v)


def _rope(params: dict[str, Any], theta: float, source: str, key: str, max_pos: int) -> RopeConfig:
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: {key} must be an object")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", theta))
    if kind == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_pos)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
    )


def _parse_v4_rope(raw: dict[str, Any], source: str) -> tuple[RopeConfig, RopeConfig]:
    """Main rope: plain, at rope_theta (sliding-only layers). Compress rope: at
    compress_rope_theta, with the YaRN scaling if any (CSA/HCA layers, compressors and
    indexer). A flat rope_scaling applies to the compress branch with attention_factor 1."""
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"{source}: rope_parameters/rope_scaling must be an object")
    theta = float(raw.get("rope_theta", 10000.0))
    ctheta = float(raw.get("compress_rope_theta", 160000.0))
    max_pos = int(raw.get("max_position_embeddings", 1 << 20))
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return (_rope(rp["main"], theta, source, "rope_parameters.main", max_pos),
                _rope(rp["compress"], ctheta, source, "rope_parameters.compress", max_pos))
    yarn = {k: v for k, v in rp.items() if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")}
    if (yarn.get("rope_type") or yarn.get("type") or "default") == "yarn":
        yarn.setdefault("attention_factor", 1.0)
    return RopeConfig(theta=theta), _rope(yarn, ctheta, source, "rope_scaling", max_pos)
