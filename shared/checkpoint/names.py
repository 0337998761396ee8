"""Map Hugging Face tensor names onto moemesh parameters.

A checkpoint may hold routed experts one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`, the Hub layout) or fused
(`mlp.experts.gate_up_proj`, the layout transformers 5 saves). Both land in the same
stacked parameter; a per-expert tensor names the slot and row range it fills.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(?P<i>\d+)\.(?P<rest>.*)$")


@dataclass(frozen=True)
class Target:
    param: str  # moemesh parameter or buffer name
    slot: int | None = None  # expert slot for per-expert tensors
    part: str | None = None  # "gate" | "up" | None (whole slot)


def hf_to_local(name: str, num_hidden_layers: int) -> Target:
    m = _LAYER.match(name)
    if m and int(m["i"]) >= num_hidden_layers:
        # The MTP layer(s) follow the target layers on disk.
        name = f"mtp.{int(m['i']) - num_hidden_layers}.{m['rest']}"
    if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
        return Target(name)
    e = _EXPERT.match(name)
    if e is None:
        return Target(name)
    proj = e["proj"]
    if proj == "down_proj":
        return Target(f"{e['pre']}.down_proj", int(e["e"]))
    return Target(f"{e['pre']}.gate_up_proj", int(e["e"]), "gate" if proj == "gate_proj" else "up")


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
