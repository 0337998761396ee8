"""The model's architecture, parsed from a Hugging Face `config.json`.

DeepSeek-V2 and DeepSeek-V3 (`model_type` `deepseek_v2` / `deepseek_v3`) parse into
ModelConfig; DeepSeek-V4 (`deepseek_v4`) into moemesh.shared.model.v4.config.V4Config, which
answers the same questions the engine asks. Both spellings of the RoPE settings found on the Hub are read: the older
`rope_scaling` + top-level `rope_theta`, and the current `rope_parameters`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moemesh.shared.model.config_fields import ConfigError, Getter, RopeConfig  # noqa: F401 (ConfigError: named here too)

if TYPE_CHECKING:
    from moemesh.shared.model.v4.config import V4Config

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v4")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per-token, per-layer width of the compressed cache: latent + rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_cache_layers(self) -> int:
        """Target layers plus the MTP layer (its KV lives in the same paged cache)."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def identity(self) -> dict[str, Any]:
        """What makes two KV caches interchangeable (used in block hashes and handshakes)."""
        d = asdict(self)
        d.pop("raw", None)
        return d

    # ---- parsing ---------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig | V4Config":
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file}: not found (a model directory needs config.json)")
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(cfg_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig | V4Config":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: top level must be a JSON object")
        mt = raw.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: unsupported model_type {mt!r}; moemesh serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if mt == "deepseek_v4":
            from moemesh.shared.model.v4.config import V4Config

            return V4Config.from_dict(raw, source)
        g = Getter(raw, source)
        is_v3 = mt == "deepseek_v3"
        n_experts = g.int("n_routed_experts", 0 if not is_v3 else None)
        eos = raw.get("eos_token_id", 1 if is_v3 else 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        topk_method = raw.get("topk_method") or ("noaux_tc" if is_v3 else "greedy")
        scoring = raw.get("scoring_func") or ("sigmoid" if is_v3 else "softmax")
        cfg = cls(
            model_type=mt,
            vocab_size=g.int("vocab_size"),
            hidden_size=g.int("hidden_size"),
            intermediate_size=g.int("intermediate_size"),
            moe_intermediate_size=g.int("moe_intermediate_size", 0 if n_experts == 0 else None),
            num_hidden_layers=g.int("num_hidden_layers"),
            num_attention_heads=g.int("num_attention_heads"),
            q_lora_rank=g.opt_int("q_lora_rank"),
            kv_lora_rank=g.int("kv_lora_rank"),
            qk_nope_head_dim=g.int("qk_nope_head_dim"),
            qk_rope_head_dim=g.int("qk_rope_head_dim"),
            v_head_dim=g.int("v_head_dim"),
            n_routed_experts=n_experts,
            n_shared_experts=g.int("n_shared_experts", 0),
            num_experts_per_tok=g.int("num_experts_per_tok", 0 if n_experts == 0 else None),
            n_group=g.opt_int("n_group") or 1,
            topk_group=g.opt_int("topk_group") or 1,
            first_k_dense_replace=g.int("first_k_dense_replace", 0),
            moe_layer_freq=g.int("moe_layer_freq", 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            scoring_func=scoring,
            topk_method=topk_method,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=g.int("max_position_embeddings", 4096),
            rope=_parse_rope(raw, source),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            num_nextn_predict_layers=g.int("num_nextn_predict_layers", raw.get("num_mtp_layers", 0) or 0),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=raw,
        )
        cfg._validate(source)
        return cfg

    def _validate(self, source: str) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        if self.scoring_func not in ("softmax", "sigmoid"):
            raise bad(f"scoring_func {self.scoring_func!r} is not supported (softmax or sigmoid)")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise bad(f"topk_method {self.topk_method!r} is not supported")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise bad(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise bad(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            per_group = self.n_routed_experts // self.n_group
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise bad("num_experts_per_tok exceeds the experts reachable in topk_group groups")
        if self.rope.kind not in ("default", "yarn"):
            raise bad(f"rope type {self.rope.kind!r} is not supported (default or yarn)")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim must be even")
        if self.num_nextn_predict_layers > 1:
            raise bad("only one MTP layer (num_nextn_predict_layers <= 1) is supported")


def _parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters/rope_scaling must be an object")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
