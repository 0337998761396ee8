"""DeepSeek-V4 tensor names: transformers' and upstream's, onto moemesh parameters.

transformers writes our names (`model.layers.{i}.self_attn.q_a_proj.weight`, fused
`mlp.experts.gate_up_proj`); the upstream release uses its own
(`layers.{i}.attn.wq_a.weight`, `layers.{i}.ffn.experts.{e}.w1.weight`, `embed.weight`)
and keeps the MTP layer under `mtp.0.` (transformers drops it, so an HF-layout folder
that has one keeps the upstream names for it). Quantized weights come with a scale
tensor: `<name>.scale` upstream, `<name>_scale_inv` in transformers' FP8 layout.
"""

from __future__ import annotations

import re

from moemesh.shared.checkpoint.names import Target

_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# Leaf renames inside a layer (upstream -> ours), most specific first.
_IN_LAYER = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("hc_head_fn", "hc_head.hc_fn"), ("hc_head_base", "hc_head.hc_base"), ("hc_head_scale", "hc_head.hc_scale"),
    ("attn.indexer.compressor.", "self_attn.compressor.indexer."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.compressor.", "self_attn.compressor."),
    ("attn.wq_a.", "self_attn.q_a_proj."), ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_b.", "self_attn.q_b_proj."), ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."), ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."), ("attn.attn_sink", "self_attn.sinks"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"), ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
]
# Inside a (possibly indexer's) compressor, after the prefix above was renamed.
_COMPRESSOR = [("wkv.", "kv_proj."), ("wgate.", "gate_proj."), ("ape", "position_bias"), ("norm.", "kv_norm.")]
_BY_OURS = sorted(_IN_LAYER, key=lambda p: -len(p[1]))  # the reverse: most specific of ours first
_EXPERT = re.compile(r"^ffn\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
_LAYER = re.compile(r"^(?P<head>layers|mtp)\.(?P<i>\d+)\.(?P<rest>.+)$")


def is_scale(name: str) -> bool:
    """A quantized weight's companion, read with its weight rather than on its own."""
    return name.endswith(".scale") or name.endswith("_scale_inv")


def scale_names(weight: str) -> tuple[str, str]:
    """Where a weight's scale may be: upstream's `.scale`, transformers' `_scale_inv`."""
    return weight.removesuffix(".weight") + ".scale", weight + "_scale_inv"


def v4_to_local(name: str) -> Target:
    """Our parameter (and expert slot / half) for a tensor of either naming."""
    if name.startswith("model.") or name.startswith("lm_head."):
        return Target(name)
    if name in _TOP:
        return Target(_TOP[name])
    m = _LAYER.match(name)
    if m is None:
        return Target(name)  # unknown: the loader reports it as unexpected
    prefix = f"model.layers.{m['i']}." if m["head"] == "layers" else f"mtp.{m['i']}."
    rest = m["rest"]
    e = _EXPERT.match(rest)
    if e is not None:
        if e["w"] == "w2":
            return Target(prefix + "mlp.experts.down_proj", int(e["e"]))
        return Target(prefix + "mlp.experts.gate_up_proj", int(e["e"]), "gate" if e["w"] == "w1" else "up")
    if rest.startswith(("self_attn.", "mlp.", "input_layernorm", "post_attention_layernorm", "attn_hc.",
                        "ffn_hc.", "hc_head.", "e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.")):
        return Target(prefix + rest)  # already our name (an MTP layer written by moemesh)
    for old, new in _IN_LAYER:
        if rest.startswith(old):
            rest = new + rest[len(old):]
            if "compressor." in new:
                tail = rest[len(new):]
                for o, n in _COMPRESSOR:
                    if tail.startswith(o):
                        rest = new + n + tail[len(o):]
                        break
            break
    return Target(prefix + rest)


def local_to_upstream(param: str, num_experts: int) -> list[str]:
    """Upstream names that make up one of our parameters (experts: one per expert)."""
    if param.startswith("model.layers.") or param.startswith("mtp."):
        parts = param.split(".")
        if parts[0] == "model":
            prefix, rest = f"layers.{parts[2]}.", ".".join(parts[3:])
        else:
            prefix, rest = f"mtp.{parts[1]}.", ".".join(parts[2:])
        if rest == "mlp.experts.gate_up_proj":
            return [f"{prefix}ffn.experts.{e}.{w}.weight" for e in range(num_experts) for w in ("w1", "w3")]
        if rest == "mlp.experts.down_proj":
            return [f"{prefix}ffn.experts.{e}.w2.weight" for e in range(num_experts)]
        for old, new in _BY_OURS:
            if rest.startswith(new):
                tail = rest[len(new):]
                if "compressor." in new:
                    for o, n in _COMPRESSOR:
                        if tail.startswith(n):
                            tail = o + tail[len(n):]
                            break
                return [prefix + old + tail]
        return [prefix + rest]
    for up, ours in _TOP.items():
        if param == ours:
            return [up]
    return [param]
