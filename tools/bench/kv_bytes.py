"""KV cache bytes per token: DeepSeek-V4's hybrid cache against V3's latent (MLA) cache.

Computed from the cache layouts the engines use (no model is loaded):
- V4: what a sequence's cache grows by per position (its blocks' main rows: compressed
  entries and index keys), plus the ring of recent positions it holds whatever its
  length (window keys, compressor projections);
- MLA (V2/V3): kv_lora_rank + qk_rope_head_dim values per position and cache layer.
"V3 at the same dimensions" is an MLA cache with V4's layer count (MTP layer included)
and V3's latent width; "V4 uncompressed" keeps every position's MQA key in every layer.
"""

from __future__ import annotations

import torch

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.v4.layout import V4Layout

CONTEXTS = (4096, 131072, 1048576)


def _per_sequence(per_token: float, fixed: int) -> dict[str, int]:
    return {str(n): int(per_token * n + fixed) for n in CONTEXTS}


def v4_row(name: str, cfg, block_size: int, dtype: torch.dtype, num_spec: int) -> dict:
    lay = V4Layout(cfg, block_size, num_spec)
    per_token = lay.bytes_per_token(dtype)
    return {"model": name, "kind": "v4", "layers": cfg.num_cache_layers, "block_size": block_size,
            "bytes_per_token": per_token, "ring_bytes": lay.ring_bytes(dtype),
            "handoff_carry_bytes": lay.carry_width * dtype.itemsize,
            "per_sequence_bytes": _per_sequence(per_token, lay.ring_bytes(dtype))}


def mla_row(name: str, layers: int, latent: int, rope: int, dtype: torch.dtype) -> dict:
    per_token = layers * (latent + rope) * dtype.itemsize
    return {"model": name, "kind": "mla", "layers": layers, "bytes_per_token": per_token, "ring_bytes": 0,
            "per_sequence_bytes": _per_sequence(per_token, 0)}


def run(dtype: torch.dtype = torch.bfloat16, num_spec: int = 1) -> dict:
    flash = ModelConfig.from_dict(preset_config("v4-flash"))
    tiny = ModelConfig.from_dict(preset_config("v4-tiny"))
    v3 = ModelConfig.from_dict(preset_config("v3"))
    rows = [
        v4_row("V4-Flash", flash, flash.block_multiple, dtype, num_spec),
        mla_row("V3 at V4-Flash's layer count", flash.num_cache_layers, v3.kv_lora_rank, v3.qk_rope_head_dim, dtype),
        mla_row("V4-Flash uncompressed (MQA key per position)", flash.num_cache_layers, flash.head_dim, 0, dtype),
        mla_row("V3 (published)", v3.num_cache_layers, v3.kv_lora_rank, v3.qk_rope_head_dim, dtype),
        v4_row("v4-tiny", tiny, 16, dtype, num_spec),
        mla_row("V3 at v4-tiny's layer count", tiny.num_cache_layers, v3.kv_lora_rank, v3.qk_rope_head_dim, dtype),
    ]
    base = rows[1]["bytes_per_token"]
    for r in rows[:4]:
        r["vs_v3_same_layers"] = r["bytes_per_token"] / base
    return {"dtype": str(dtype).removeprefix("torch."), "num_speculative_tokens": num_spec, "rows": rows}


def handoff_sizes(context_lens: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, num_spec: int = 1,
                  mla_block_size: int = 16) -> list[dict]:
    """Bytes one request's prefill -> decode hand-off moves at each context length, as the
    engines size the buffer (`KVSpec.nbytes`): V4-Flash's main rows of its whole blocks
    plus the ring's look-back, and an MLA cache's rows of its whole blocks (V3 as
    published, and at V4-Flash's layer count)."""
    flash = ModelConfig.from_dict(preset_config("v4-flash"))
    v3 = ModelConfig.from_dict(preset_config("v3"))
    lay = V4Layout(flash, flash.block_multiple, num_spec)
    mla = (("V3 (published)", v3.num_cache_layers), ("V3 at V4-Flash's layer count", flash.num_cache_layers))
    rows = []
    for n in context_lens:
        blocks = -(-n // lay.block_size)
        rows.append({"cache": "V4-Flash", "context_len": n, "block_size": lay.block_size,
                     "bytes": (blocks * lay.main_width + lay.carry_width) * dtype.itemsize})
        for name, layers in mla:
            blocks = -(-n // mla_block_size)
            rows.append({"cache": name, "context_len": n, "block_size": mla_block_size,
                         "bytes": layers * blocks * mla_block_size * (v3.kv_lora_rank + v3.qk_rope_head_dim)
                         * dtype.itemsize})
    return rows


def table(result: dict) -> str:
    def mib(b: float) -> str:
        return f"{b / 2**20:,.1f}"

    head = (f"{'cache (' + result['dtype'] + ')':<46} {'B/token':>9} {'ring MiB':>9} "
            + " ".join(f"{'MiB @' + str(n // 1024) + 'k':>12}" for n in CONTEXTS) + f" {'vs V3':>7}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        ratio = f"{r['vs_v3_same_layers']:.3f}" if "vs_v3_same_layers" in r else ""
        lines.append(f"{r['model']:<46} {r['bytes_per_token']:>9,.0f} {mib(r['ring_bytes']):>9} "
                     + " ".join(f"{mib(r['per_sequence_bytes'][str(n)]):>12}" for n in CONTEXTS) + f" {ratio:>7}")
    return "\n".join(lines)
