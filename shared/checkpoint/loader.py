"""Load a Hugging Face layout checkpoint into a DeepseekForCausalLM.

Parameters are allocated once, uninitialised, and each tensor is read from disk straight
into its parameter (see safetensors_io), so peak memory is the model plus at most one
tensor, and no file is memory-mapped.
Every failure is a CheckpointError whose message names the file and the tensor.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from shared.checkpoint.names import Target, hf_to_local
from shared.checkpoint.safetensors_io import SafetensorsFile, SafetensorsFormatError
from shared.model.config import ConfigError, ModelConfig
from shared.model.deepseek import DeepseekForCausalLM
from shared.model.rope import RotaryEmbedding

log = logging.getLogger(__name__)

class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says which file and tensor."""


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: lists {f.name}, which does not exist")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no model.safetensors, index or *.safetensors files")
    return files


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_empty(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                num_slots: int | None = None) -> DeepseekForCausalLM:
    """Allocate the model's parameters without initialising them."""
    with torch.device("meta"), _default_dtype(dtype):
        model = DeepseekForCausalLM(cfg, num_slots)
    model.to_empty(device=device)
    model.rope = RotaryEmbedding(cfg).to(device)
    return model


ExpertSlots = Callable[[int], list[int]]  # MoE layer id -> logical expert held in each local slot


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    expert_slots: ExpertSlots | None = None, num_slots: int | None = None,
) -> DeepseekForCausalLM:
    """expert_slots/num_slots: under expert parallelism, which experts this rank holds;
    only those are read from disk. By default every expert, slot e holding expert e."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory does not exist")
    try:
        cfg = ModelConfig.from_dir(model_dir)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    files = weight_files(model_dir)
    names_by_file = {f: _tensor_names(f) for f in files}
    all_names = {n for names in names_by_file.values() for n in names}
    if cfg.has_mtp and not any(hf_to_local(n, cfg.num_hidden_layers).param.startswith("mtp.") for n in all_names):
        log.warning("%s: config asks for an MTP layer but the checkpoint has none; speculative decoding is off", model_dir)
        cfg = replace(cfg, num_nextn_predict_layers=0)

    model = build_empty(cfg, dtype, device, num_slots)
    slots_of = expert_slots or (lambda layer: list(range(cfg.n_routed_experts)))
    state = dict(model.named_parameters())
    state.update({n: b for n, b in model.named_buffers() if n != "rope.cos" and n != "rope.sin"})
    pending: dict[str, set] = {n: _pieces(n, t) for n, t in state.items()}

    for f in files:
        try:
            with SafetensorsFile(f) as sf:
                for name in names_by_file[f]:
                    target = hf_to_local(name, cfg.num_hidden_layers)
                    dest = state.get(target.param)
                    if dest is None:
                        raise CheckpointError(
                            f"{f.name}: unexpected tensor {name!r} (no such parameter in {cfg.model_type})")
                    if target.param.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                        layer = _layer_of(target.param, cfg.num_hidden_layers)
                        _copy_experts(dest, target, slots_of(layer), cfg.n_routed_experts, sf, f.name, name,
                                      pending[target.param])
                    else:
                        _copy(dest, target, sf, f.name, name)
                        _mark(pending, target)
        except SafetensorsFormatError as e:
            raise CheckpointError(f"{model_dir}/{e}") from None
        except OSError as e:
            raise CheckpointError(f"{f}: could not read ({e})") from None

    _tie_optional(model, pending, cfg)
    missing = sorted(n for n, left in pending.items() if left)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{model_dir}: missing tensors {', '.join(missing[:5])}{more}")
    model.eval().requires_grad_(False)
    return model


def _tensor_names(f: Path) -> list[str]:
    try:
        with SafetensorsFile(f) as sf:
            return sf.keys()
    except SafetensorsFormatError as e:
        raise CheckpointError(f"{f.parent}/{e}") from None
    except OSError as e:
        raise CheckpointError(f"{f}: could not read ({e})") from None


def _pieces(name: str, t: torch.Tensor) -> set:
    if name.endswith(".mlp.experts.gate_up_proj"):
        return {(s, p) for s in range(t.shape[0]) for p in ("gate", "up")}
    if name.endswith(".mlp.experts.down_proj"):
        return {(s, None) for s in range(t.shape[0])}
    return {None}


def _layer_of(param: str, num_hidden_layers: int) -> int:
    head, idx = param.split(".")[:2] if param.startswith("mtp.") else param.split(".")[1:3]
    return int(idx) + (num_hidden_layers if head == "mtp" else 0)


def _copy_experts(dest: torch.Tensor, target: Target, slots: list[int], num_experts: int, sf: SafetensorsFile,
                  fname: str, name: str, pending: set) -> None:
    """Fill the local slots that hold the tensor's expert(s); others belong to other ranks."""
    shape = sf.tensors[name].shape
    if target.slot is None:  # fused: [E, ...]
        if shape != (num_experts, *dest.shape[1:]):
            raise CheckpointError(
                f"{fname}: tensor {name!r} has shape {shape}, expected {(num_experts, *dest.shape[1:])}")
        with torch.no_grad():
            for s, e in enumerate(slots):
                sf.read_row_into(name, e, dest[s])
        for s in range(len(slots)):
            pending.difference_update({(s, None), (s, "gate"), (s, "up")})
        return
    if target.slot >= num_experts:
        raise CheckpointError(
            f"{fname}: tensor {name!r} names expert {target.slot}, but the config has {num_experts}")
    for s, e in enumerate(slots):
        if e != target.slot:
            continue
        view = dest[s]
        if target.part is not None:
            half = view.shape[0] // 2
            view = view[:half] if target.part == "gate" else view[half:]
        if tuple(view.shape) != shape:
            raise CheckpointError(f"{fname}: tensor {name!r} has shape {shape}, expected {tuple(view.shape)}")
        with torch.no_grad():
            sf.read_into(name, view)
        pending.discard((s, target.part))


def _copy(dest: torch.Tensor, target: Target, sf: SafetensorsFile, fname: str, name: str) -> None:
    shape = sf.tensors[name].shape
    if tuple(dest.shape) != shape:
        raise CheckpointError(f"{fname}: tensor {name!r} has shape {shape}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        sf.read_into(name, dest)


def _mark(pending: dict[str, set], target: Target) -> None:
    pending[target.param].clear()


def _tie_optional(model: DeepseekForCausalLM, pending: dict[str, set], cfg: ModelConfig) -> None:
    # The MTP layer reuses the target's embedding and head when a checkpoint omits its copies.
    for j, m in enumerate(model.mtp):
        if pending.get(f"mtp.{j}.embed_tokens.weight"):
            m.embed_tokens.weight = model.model.embed_tokens.weight
            pending[f"mtp.{j}.embed_tokens.weight"].clear()
        if pending.get(f"mtp.{j}.shared_head.head.weight"):
            m.shared_head.head.weight = model.lm_head.weight
            pending[f"mtp.{j}.shared_head.head.weight"].clear()
    if cfg.tie_word_embeddings and pending.get("lm_head.weight"):
        model.lm_head.weight = model.model.embed_tokens.weight
        pending["lm_head.weight"].clear()
