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


def build_empty(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> DeepseekForCausalLM:
    """Allocate the model's parameters without initialising them."""
    with torch.device("meta"), _default_dtype(dtype):
        model = DeepseekForCausalLM(cfg)
    model.to_empty(device=device)
    model.rope = RotaryEmbedding(cfg).to(device)
    return model


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DeepseekForCausalLM:
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

    model = build_empty(cfg, dtype, device)
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


def _dest_view(dest: torch.Tensor, target: Target) -> torch.Tensor:
    if target.slot is None:
        return dest
    if target.slot >= dest.shape[0]:
        raise IndexError(target.slot)
    view = dest[target.slot]
    if target.part is None:
        return view
    half = view.shape[0] // 2
    return view[:half] if target.part == "gate" else view[half:]


def _copy(dest: torch.Tensor, target: Target, sf: SafetensorsFile, fname: str, name: str) -> None:
    try:
        view = _dest_view(dest, target)
    except IndexError:
        raise CheckpointError(
            f"{fname}: tensor {name!r} names expert {target.slot}, but the config has {dest.shape[0]}") from None
    shape = sf.tensors[name].shape
    if tuple(view.shape) != shape:
        raise CheckpointError(f"{fname}: tensor {name!r} has shape {shape}, expected {tuple(view.shape)}")
    with torch.no_grad():
        sf.read_into(name, view)


def _mark(pending: dict[str, set], target: Target) -> None:
    left = pending[target.param]
    if target.slot is None:
        left.clear()
    else:
        left.discard((target.slot, target.part))


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
