"""DeepSeek-V4 tensor names onto moemesh parameters, and back to the upstream ones.

Three spellings are in the wild, and the resolver reads each, with or without the
`model.` prefix:
- upstream's (`layers.{i}.attn.wq_a.weight`, `layers.{i}.ffn.experts.{e}.w1.weight`,
  `embed.weight`, `hc_head_fn`, the MTP layer under `mtp.0.`);
- transformers' in-memory names, which are ours (`model.layers.{i}.self_attn.q_a_proj.weight`,
  fused `mlp.experts.gate_up_proj`, `model.layers.{i}.mlp.gate.tid2eid`);
- what transformers' `save_pretrained` writes: it reverses its load-time conversion, so
  upstream leaf names under transformers' prefixes (`model.layers.{i}.attn.wkv.weight`,
  `model.embed_tokens.weight`, `model.hc_head.hc_fn`, `head.weight`).

The rules are transformers' own conversion rules for `deepseek_v4`
(`transformers/conversion_mapping.py`): key patterns, applied in order, every match
firing, each a no-op on a name already in our spelling. One differs: transformers strips
the `model.` prefix before its unscoped `.norm.` -> `.kv_norm.` rule and never loads the
MTP layer, whose own final `norm.weight` that rule would rename; here the rule is scoped
to the attention, compressor and indexer norms it is meant for.

Quantized weights come with a scale tensor: `<name>.scale` upstream, `<name>_scale_inv`
in transformers' FP8 layout.
"""

from __future__ import annotations

import re

from moemesh.shared.checkpoint.names import Target, resolve_key

# (pattern, replacement), in transformers' order.
_RULES = [(re.compile(p), r) for p, r in [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"(^|\.)hc_head_(fn|base|scale)$", r"\1hc_head.hc_\2"),  # the model's and the MTP layer's
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."),  # scoped: see the module docstring
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]]
_MODEL_TOP = ("embed_tokens.weight", "norm.weight", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale")


class V4Names:
    """DeepSeek-V4, every spelling above; routed experts per-expert (w1/w3/w2) or fused."""

    def resolve(self, name: str) -> Target | None:
        key = name.removeprefix("model.")
        for pattern, repl in _RULES:
            key = pattern.sub(repl, key, count=1)
        return resolve_key(key, _MODEL_TOP, _prefix)


def _prefix(head: str, i: int) -> str:
    return f"model.layers.{i}." if head == "layers" else f"mtp.{i}."


# ---- writing the upstream layout ------------------------------------------------------
# Ours -> upstream, for the writer's upstream layout and for naming missing tensors the
# way the release does. tests/checkpoint/test_names.py holds it to the rules above.
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


def is_scale(name: str) -> bool:
    """A quantized weight's companion, read with its weight rather than on its own."""
    return name.endswith(".scale") or name.endswith("_scale_inv")


def scale_names(weight: str) -> tuple[str, str]:
    """Where a weight's scale may be: upstream's `.scale`, transformers' `_scale_inv`."""
    return weight.removesuffix(".weight") + ".scale", weight + "_scale_inv"


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
