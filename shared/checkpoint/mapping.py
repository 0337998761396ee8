"""Which checkpoint tensor fills which parameter: resolved and checked before a byte of
weights is read, so that a bad checkpoint fails in one line, naming the tensor.

Pure: it sees tensor names, the files that hold them and the model's parameter names,
never the data. What it refuses:
- a name no rule of the architecture reads, or one that reads as no parameter;
- two tensors for one parameter (or one expert of it): names that mix two layouts so
  that they contradict each other. Mixing spellings is otherwise fine, and common:
  transformers itself writes `head.weight` beside `model.layers.*`;
- an expert index past the config's;
- for DeepSeek-V4, a hash-routed layer without its routing table (`tid2eid`), or a
  routing table for a layer the config routes by score.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moemesh.shared.checkpoint.names import Target


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says which file and tensor."""


def hash_table(layer: int) -> str:
    """Our name for a hash-routed layer's token -> experts table."""
    return f"model.layers.{layer}.mlp.gate.tid2eid"


def check_all(resolved: dict[str, Target | None], file_of: dict[str, Path], params: set[str],
              cfg) -> dict[str, Target]:
    """Args: what the architecture's resolver read each tensor name as (names read with
    another tensor, quantization scales, left out); every tensor name -> its file; the
    model's parameter and buffer names; its config. Returns: tensor name -> the
    parameter piece it fills."""
    targets: dict[str, Target] = {}
    owner: dict[tuple[str, object], str] = {}  # (param, piece) -> the tensor that fills it
    num_experts = cfg.n_routed_experts
    for name, t in resolved.items():
        f = file_of[name]
        if t is None:
            raise CheckpointError(f"{f.name}: unexpected tensor {name!r} (no {cfg.model_type} tensor is named so)")
        if t.param not in params:
            raise CheckpointError(_unexpected(f.name, name, t, cfg))
        if t.slot is not None and t.slot >= num_experts:
            raise CheckpointError(
                f"{f.name}: tensor {name!r} names expert {t.slot}, but the config has {num_experts}")
        for piece in sorted(t.pieces(num_experts), key=_in_order):
            other = owner.setdefault((t.param, piece), name)
            if other != name:
                what = t.param if piece is None else f"{t.param} (expert {piece[0]})"
                raise CheckpointError(
                    f"{f.name}: tensors {other!r} ({file_of[other].name}) and {name!r} both hold {what}: the "
                    f"checkpoint mixes two layouts; each parameter is expected once, in one of them")
        targets[name] = t
    if cfg.model_type == "deepseek_v4":
        _check_hash_tables(targets, file_of, cfg)
    return targets


def _in_order(piece) -> tuple[int, str]:
    return (-1, "") if piece is None else (piece[0], piece[1] or "")


def _unexpected(fname: str, name: str, t: Target, cfg) -> str:
    if cfg.model_type == "deepseek_v4" and t.param.endswith(".mlp.gate.tid2eid"):
        hashed = [i for i in range(cfg.num_hidden_layers) if cfg.is_hash_layer(i)]
        return (f"{fname}: tensor {name!r} is a hash routing table, but the config routes that layer by score "
                f"(hash-routed layers: {', '.join(map(str, hashed)) or 'none'}; mlp_layer_types or num_hash_layers)")
    return f"{fname}: unexpected tensor {name!r} (read as {t.param!r}: no such parameter in {cfg.model_type})"


def _check_hash_tables(targets: dict[str, Target], file_of: dict[str, Path], cfg) -> None:
    held = {t.param for t in targets.values()}
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_hash_layer(i) or hash_table(i) in held:
            continue
        # Spell the expected name as this checkpoint spells the layer's router.
        router = next((n for n, t in targets.items() if t.param == f"model.layers.{i}.mlp.gate.weight"), None)
        expected = router.removesuffix("weight") + "tid2eid" if router else f"layers.{i}.ffn.gate.tid2eid"
        where = file_of[router].name + ": " if router else ""
        raise CheckpointError(
            f"{where}layer {i} is hash-routed (mlp_layer_types[{i}] is 'hash_moe') but its routing table is "
            f"missing: expected tensor {expected!r}, integers of shape [vocab_size, num_experts_per_tok] = "
            f"[{cfg.vocab_size}, {cfg.num_experts_per_tok}]")


def check_hash_table(fname: str, name: str, shape: tuple[int, ...], dtype, cfg) -> None:
    """A routing table's shape and dtype, against the config (its values: check_expert_ids)."""
    want = (cfg.vocab_size, cfg.num_experts_per_tok)
    if tuple(shape) != want:
        raise CheckpointError(
            f"{fname}: tensor {name!r} has shape {tuple(shape)}, but a hash routing table is [vocab_size, "
            f"num_experts_per_tok] = {list(want)} by the config")
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise CheckpointError(f"{fname}: tensor {name!r} is stored as {dtype}; a hash routing table holds "
                              f"expert ids, as integers")


def check_expert_ids(fname: str, name: str, lo: int, hi: int, num_experts: int) -> None:
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise CheckpointError(f"{fname}: tensor {name!r} routes to expert {bad}, but the config has "
                              f"{num_experts} routed experts (0..{num_experts - 1})")
