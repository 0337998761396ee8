"""Checkpoint tensor names onto moemesh parameters: one resolver per architecture.

A real checkpoint spells a parameter in one of several ways, and a resolver accepts
each of them:
- the release's own names (for V2/V3 that is the Hub layout: one tensor per routed
  expert, `model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, the MTP layer(s) as
  `model.layers.{num_hidden_layers + j}`; V4's upstream names are in names_v4.py);
- transformers' in-memory names (fused `mlp.experts.gate_up_proj` / `down_proj`),
  which are also moemesh's own;
- what transformers' `save_pretrained` writes: it reverses its load-time conversion,
  which for V2/V3 gives the Hub layout back;
- any of these with or without the base model's `model.` prefix (transformers adds or
  strips it on load, so a checkpoint of the bare model loads too).

Rules are key patterns, as transformers' conversion rules are, so they hold whatever
prefix a tensor carries. A name no rule reads resolves to None, and the loader names it.

Glossary: a *piece* of a parameter is what one tensor fills: the whole parameter, or for
stacked experts one expert's slot, or one half (gate / up) of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Target:
    param: str  # moemesh parameter or buffer name
    slot: int | None = None  # expert for per-expert tensors
    part: str | None = None  # "gate" | "up" | None (whole slot)

    def pieces(self, num_experts: int) -> set:
        """What this tensor fills: (expert, half) for experts, None for a plain parameter."""
        if self.param.endswith(_STACKED[0]):
            if self.slot is None:
                return {(e, p) for e in range(num_experts) for p in ("gate", "up")}
            return {(self.slot, self.part)}
        if self.param.endswith(_STACKED[1]):
            return {(e, None) for e in range(num_experts)} if self.slot is None else {(self.slot, None)}
        return {None}


class Names(Protocol):
    """The seam between a checkpoint's spelling and the model's parameters."""

    def resolve(self, name: str) -> Target | None:
        """Args: a tensor name as stored. Returns: the parameter (and expert piece) it
        fills, or None when no rule of this architecture reads the name."""


# Per-expert spellings of one routed expert's three matrices: the Hub's and upstream's.
_PER_EXPERT = re.compile(r"^mlp\.experts\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_HALF = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}
_STACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
_LAYER = re.compile(r"^(?P<head>layers|mtp)\.(?P<i>\d+)\.(?P<rest>.+)$")


def in_layer(prefix: str, rest: str) -> Target:
    """A tensor inside one decoder (or MTP) layer, `rest` already in our spelling but for
    the routed experts, which may be per-expert (either spelling) or fused."""
    e = _PER_EXPERT.match(rest)
    if e is not None:
        if e["w"] in _HALF:
            return Target(prefix + "mlp.experts.gate_up_proj", int(e["e"]), _HALF[e["w"]])
        return Target(prefix + "mlp.experts.down_proj", int(e["e"]))
    return Target(prefix + rest)


def resolve_key(key: str, model_top: tuple[str, ...], layer_prefix) -> Target | None:
    """What both architectures do once a key (no `model.` prefix) is in our spelling:
    the model's top-level tensors (`model_top`), the head, and tensors inside a layer,
    whose prefix `layer_prefix(head, index)` gives ('layers' or 'mtp', as on disk)."""
    if key in model_top:
        return Target("model." + key)
    if key == "lm_head.weight":
        return Target(key)
    m = _LAYER.match(key)
    return None if m is None else in_layer(layer_prefix(m["head"], int(m["i"])), m["rest"])


class V3Names:
    """DeepSeek-V2 and V3. The MTP layer(s) follow the target layers on disk."""

    def __init__(self, num_hidden_layers: int):
        self.num_hidden_layers = num_hidden_layers

    def resolve(self, name: str) -> Target | None:
        return resolve_key(name.removeprefix("model."), ("embed_tokens.weight", "norm.weight"), self._prefix)

    def _prefix(self, head: str, i: int) -> str:
        if head == "mtp":  # moemesh's own name for it
            return f"mtp.{i}."
        if i >= self.num_hidden_layers:
            return f"mtp.{i - self.num_hidden_layers}."
        return f"model.layers.{i}."


def local_to_hf_names(param: str, num_slots: int, num_hidden_layers: int) -> list[str]:
    """Hub-layout names (per-expert) that together make up one moemesh parameter."""
    if param.startswith("mtp."):
        j, rest = param[4:].split(".", 1)
        param = f"model.layers.{num_hidden_layers + int(j)}.{rest}"
    if param.endswith(".mlp.experts.gate_up_proj"):
        pre = param[: -len(".gate_up_proj")]
        return [f"{pre}.{e}.{p}.weight" for e in range(num_slots) for p in ("gate_proj", "up_proj")]
    if param.endswith(".mlp.experts.down_proj"):
        pre = param[: -len(".down_proj")]
        return [f"{pre}.{e}.down_proj.weight" for e in range(num_slots)]
    return [param]


def is_experts(param: str) -> bool:
    """A stacked parameter of routed experts: [E, ...], filled whole or one expert at a time."""
    return param.endswith(_STACKED)
