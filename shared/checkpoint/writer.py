"""`moemesh init-model`: write a seeded random-weight checkpoint in Hugging Face layout.

Every tensor is drawn from its own generator, seeded from (seed, tensor name), so the
result does not depend on write order, sharding or layout. The layouts:
- `transformers` (the default where transformers is installed): named as transformers'
  `save_pretrained` writes them, by transformers' own conversion (writer_transformers.py);
- `hf`: V2/V3 as on the Hub (routed experts one tensor per expert, unless
  `fused_experts` asks for the fused layout), V4 under transformers' in-memory names;
- `upstream` (V4): the release's own names, optionally FP8/FP4 (writer_v4.py).
Every tensor is random, the router's correction bias included, so a reference
implementation that zero-initialises something cannot agree with us by accident.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from moemesh.shared.checkpoint.names import local_to_hf_names
from moemesh.shared.checkpoint.seeding import seed_for
from moemesh.shared.checkpoint.presets import REAL_DIMENSIONS, TOKENIZER_VOCAB, VOCAB_FROM_TOKENIZER, preset_config
from moemesh.shared.checkpoint.tokenizer_builder import build_tokenizer, write_tokenizer
from moemesh.shared.checkpoint.writer_v4 import QUANT_CONFIG, v4_tensors
from moemesh.shared.checkpoint import writer_transformers
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.deepseek import DeepseekForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _shared_source(name: str, num_layers: int) -> str | None:
    """Real V3 checkpoints store copies of the embedding and head inside the MTP layer."""
    if name == f"model.layers.{num_layers}.embed_tokens.weight":
        return "model.embed_tokens.weight"
    if name == f"model.layers.{num_layers}.shared_head.head.weight":
        return "lm_head.weight"
    return None


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed_for(seed, name))
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if name.endswith("norm.weight"):
        x = 1.0 + 0.1 * x
    elif name.endswith("e_score_correction_bias"):
        return (0.1 * x).to(torch.float32)
    elif name.endswith("embed_tokens.weight"):
        pass
    elif name.endswith("lm_head.weight") or name.endswith("shared_head.head.weight"):
        x = x * (3.0 / math.sqrt(shape[-1]))  # peaked logits, so greedy choices are not near-ties
    else:
        x = x / math.sqrt(shape[-1])
    return x.to(dtype)


def _hf_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in the Hub layout, in a stable order."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg)
    out: list[tuple[str, tuple[int, ...]]] = []
    items = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if not n.startswith("rope.")]
    for local, t in items:
        names = local_to_hf_names(local, t.shape[0] if t.dim() else 0, cfg.num_hidden_layers)
        if local.endswith(".mlp.experts.gate_up_proj"):
            out += [(n, (t.shape[1] // 2, t.shape[2])) for n in names]
        elif local.endswith(".mlp.experts.down_proj"):
            out += [(n, tuple(t.shape[1:])) for n in names]
        else:
            out.append((names[0], tuple(t.shape)))
    return out


def _fuse_names(tensors: list[tuple[str, tuple[int, ...]]], cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    out, seen = [], set()
    for name, shape in tensors:
        if ".mlp.experts." not in name:
            out.append((name, shape))
            continue
        pre = name.split(".mlp.experts.")[0] + ".mlp.experts"
        if pre in seen:
            continue
        seen.add(pre)
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        out += [(f"{pre}.gate_up_proj", (E, 2 * I, D)), (f"{pre}.down_proj", (E, D, I))]
    return out


def _materialise(name: str, shape, cfg: ModelConfig, seed: int, dtype: torch.dtype) -> torch.Tensor:
    src = _shared_source(name, cfg.num_hidden_layers)
    if src is not None:
        return random_tensor(src, shape, seed, dtype)
    if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
        pre, kind = name.rsplit(".", 1)
        per = []
        for e in range(shape[0]):
            if kind == "gate_up_proj":
                half = (shape[1] // 2, shape[2])
                per.append(torch.cat([random_tensor(f"{pre}.{e}.{p}.weight", half, seed, dtype)
                                      for p in ("gate_proj", "up_proj")]))
            else:
                per.append(random_tensor(f"{pre}.{e}.down_proj.weight", shape[1:], seed, dtype))
        return torch.stack(per)
    return random_tensor(name, shape, seed, dtype)


def init_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str | None = None,
    num_layers: int | None = None,
    shard_size: int = 2 << 30,
    fused_experts: bool = False,
    layout: str | None = None,
    quantize: bool = False,
    overrides: dict | None = None,
    tokenizer_texts: list[str] | None = None,
) -> Path:
    """layout: transformers, hf or (V4) upstream; by default upstream when quantizing, hf
    for fused experts, else transformers where it is installed, else hf. quantize: V4's published FP8/FP4
    storage, in the upstream layout. tokenizer_texts: the text the tokenizer learns its merges
    from (a model about to be trained on it); by default a seeded word-list corpus."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = preset_config(preset, num_layers)
    for k, v in (overrides or {}).items():  # tests: architectures the presets do not cover (None drops a key)
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    tok = build_tokenizer(TOKENIZER_VOCAB[preset], tokenizer_texts)
    if preset in VOCAB_FROM_TOKENIZER:
        raw["vocab_size"] = tok.get_vocab_size()
    dtype = dtype or ("bfloat16" if preset in REAL_DIMENSIONS else "float32")
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}")
    raw["torch_dtype"] = dtype
    cfg = ModelConfig.from_dict(raw)
    tdtype = _DTYPES[dtype]
    layout = layout or ("hf" if fused_experts else default_layout(quantize))
    if layout == "transformers" and not writer_transformers.available():
        raise ValueError("--layout transformers needs transformers installed (pip install transformers)")
    if layout == "transformers" and fused_experts:
        raise ValueError("--fused-experts writes transformers' in-memory names, the hf layout: its save path "
                         "splits the experts (drop --layout transformers)")
    if cfg.model_type == "deepseek_v4":
        if quantize and layout != "upstream":
            raise ValueError("--quantize writes the upstream layout: add --layout upstream")
        if quantize:
            raw["quantization_config"] = dict(QUANT_CONFIG)
            raw["expert_dtype"] = "fp4"
        tensors = v4_tensors(cfg, seed, tdtype, "ours" if layout == "transformers" else layout, quantize)
        if layout == "transformers":
            tensors = writer_transformers.as_saved(raw, tensors)
        write_shards(out, tensors, shard_size)
        return _write_meta(out, raw, tok, {"preset": preset, "seed": seed, "dtype": dtype,
                                           "num_layers": cfg.num_hidden_layers, "layout": layout,
                                           "quantized": quantize})
    if layout not in ("hf", "transformers") or quantize:
        raise ValueError("--layout upstream and --quantize apply to DeepSeek-V4 presets only")
    info = {"preset": preset, "seed": seed, "dtype": dtype, "num_layers": cfg.num_hidden_layers, "layout": layout,
            "fused_experts": fused_experts}
    tensors = _hf_tensors(cfg)
    if fused_experts or layout == "transformers":
        tensors = _fuse_names(tensors, cfg)
    if layout == "transformers":  # from transformers' in-memory (fused) names
        named = ((n, _materialise(n, shape, cfg, seed, tdtype)) for n, shape in tensors)
        write_shards(out, writer_transformers.as_saved(raw, named), shard_size)
        return _write_meta(out, raw, tok, info)

    def nbytes(name: str, shape) -> int:
        elem = 4 if name.endswith("e_score_correction_bias") else tdtype.itemsize
        return math.prod(shape) * elem

    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        b = nbytes(name, shape)
        if shards[-1] and size + b > shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += b
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {name: _materialise(name, shape, cfg, seed, tdtype).contiguous() for name, shape in shard}
        save_file(data, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in data})
        del data
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes(n, s) for n, s in tensors)}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return _write_meta(out, raw, tok, info)


def default_layout(quantize: bool = False) -> str:
    """What a user most likely downloads, as far as this machine can write it."""
    if quantize:
        return "upstream"
    return "transformers" if writer_transformers.available() else "hf"


def write_shards(out: Path, tensors, shard_size: int) -> None:
    """Streams (name, tensor) into shards of about shard_size bytes, then the index."""
    shard: dict[str, torch.Tensor] = {}
    done: list[dict[str, int]] = []  # per shard: name -> bytes
    size = 0

    def flush() -> None:
        tmp = out / f".shard-{len(done):05d}.safetensors"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        done.append({n: t.numel() * t.element_size() for n, t in shard.items()})
        shard.clear()

    for name, t in tensors:
        b = t.numel() * t.element_size()
        if shard and size + b > shard_size:
            flush()
            size = 0
        shard[name] = t.contiguous()
        size += b
    if shard or not done:
        flush()
    weight_map: dict[str, str] = {}
    for i, names in enumerate(done):
        fname = "model.safetensors" if len(done) == 1 else f"model-{i + 1:05d}-of-{len(done):05d}.safetensors"
        (out / f".shard-{i:05d}.safetensors").rename(out / fname)
        weight_map.update({n: fname for n in names})
    if len(done) > 1:
        total = sum(sum(d.values()) for d in done)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_meta(out: Path, raw: dict, tok, info: dict) -> Path:
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(out, tok, raw["max_position_embeddings"])
    (out / "moemesh_init.json").write_text(json.dumps(info, indent=2) + "\n")
    return out
