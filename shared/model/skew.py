"""Routing skew on purpose, for balanced-versus-skewed benchmarks.

A skew adds a fixed bias to the router's choice scores (never to the routing
weights), so a few experts win more often, reproducibly. Spellings:
  zipf:A           popularity ~ 1/rank^A over a seeded random order of experts
  hot:E1,E2,...:B  the named experts get +B
  hist:PATH        bias = log of a recorded per-expert histogram (JSON list, or
                   {"layers": {layer: [counts]}} per layer)
The bias is scaled so that its spread is comparable to the router's sigmoid/softmax
scores; `strength` scales it further.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


class SkewError(ValueError):
    pass


def choice_bias(spec: str, num_experts: int, layer_id: int, seed: int = 0, strength: float = 1.0) -> torch.Tensor | None:
    """[E] fp32 bias for one layer, or None for no skew."""
    if not spec:
        return None
    kind, _, arg = spec.partition(":")
    g = torch.Generator().manual_seed(seed * 10_007 + layer_id)
    if kind == "zipf":
        try:
            a = float(arg)
        except ValueError:
            raise SkewError(f"skew {spec!r}: zipf needs an exponent, e.g. zipf:0.69") from None
        order = torch.randperm(num_experts, generator=g)
        pop = torch.empty(num_experts)
        pop[order] = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float32) ** a
        bias = torch.log(pop / pop.mean())
    elif kind == "hot":
        ids_s, _, b = arg.rpartition(":")
        try:
            ids = [int(x) for x in ids_s.split(",") if x]
            b = float(b)
        except ValueError:
            raise SkewError(f"skew {spec!r}: expected hot:E1,E2,...:BIAS") from None
        if not ids or min(ids) < 0 or max(ids) >= num_experts:
            raise SkewError(f"skew {spec!r}: expert ids must be in [0, {num_experts})")
        bias = torch.zeros(num_experts)
        bias[ids] = b
        return bias * strength
    elif kind == "hist":
        bias = _hist_bias(arg, num_experts, layer_id)
    else:
        raise SkewError(f"unknown skew {spec!r}; use zipf:A, hot:E1,E2:B or hist:PATH")
    return bias * (strength * 0.25)  # log-popularity spans ~5 nats; router scores span ~1


def _hist_bias(path: str, num_experts: int, layer_id: int) -> torch.Tensor:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SkewError(f"skew histogram {path}: {e}") from None
    counts = data
    if isinstance(data, dict):
        layers = data.get("layers", {})
        counts = layers.get(str(layer_id)) or layers.get(layer_id) or data.get("default")
    if not isinstance(counts, list) or len(counts) != num_experts:
        raise SkewError(f"skew histogram {path}: need {num_experts} counts for layer {layer_id}")
    c = torch.tensor([max(float(x), 0.0) for x in counts]) + 1.0
    return torch.log(c / c.mean())


def apply_skew(model, target: str, draft: str, seed: int = 0) -> None:
    """Set each MoE router's choice bias: `target` for the model's layers, `draft` for MTP."""
    E = model.cfg.n_routed_experts
    for lid, moe in model.moe_layers().items():
        spec = draft if lid >= model.cfg.num_hidden_layers else target
        moe.gate.choice_bias = choice_bias(spec, E, lid, seed)
