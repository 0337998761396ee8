"""Load a Hugging Face layout checkpoint into a DeepseekForCausalLM (V2/V3) or a
DeepseekV4ForCausalLM.

Parameters are allocated once, uninitialised, and each tensor is read from disk straight
into its parameter (see safetensors_io), so peak memory is the model plus at most one
tensor, and no file is memory-mapped. Tensor names may be spelled as the release, as
transformers in memory or as transformers' `save_pretrained` spells them (names.py,
names_v4.py); which tensor fills which parameter is settled and checked before any
weight is read (mapping.py). V4 checkpoints may store FP8 / FP4 weights with scales:
those are dequantized as they are read (quant.py), since no kernel here takes them
directly. Every failure is a CheckpointError whose message names the file and the tensor.
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from moemesh.shared.checkpoint.mapping import CheckpointError, check_all, check_expert_ids, check_hash_table
from moemesh.shared.checkpoint.names import Target, V3Names, is_experts
from moemesh.shared.checkpoint.names_v4 import V4Names, is_scale, local_to_upstream, scale_names
from moemesh.shared.checkpoint.quant import QuantSpec, dequant_fp4, dequant_fp8_block
from moemesh.shared.checkpoint.safetensors_io import SafetensorsFile, SafetensorsFormatError
from moemesh.shared.model.config import ConfigError, ModelConfig
from moemesh.shared.model.deepseek import DeepseekForCausalLM
from moemesh.shared.model.layers import unfuse_moved
from moemesh.shared.model.rope import RotaryEmbedding
from moemesh.shared.model.v4.model import DeepseekV4ForCausalLM
from moemesh.shared.model.v4.rope import Rope

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "build_empty", "load_model", "weight_files"]


def _weight_map(model_dir: Path) -> dict[str, str] | None:
    """The safetensors index's tensor -> file map, or None without an index."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    return weight_map


def weight_files(model_dir: Path, weight_map: dict[str, str] | None = None) -> list[Path]:
    """weight_map: the index's, when the caller has read it already."""
    weight_map = weight_map if weight_map is not None else _weight_map(model_dir)
    if weight_map is not None:
        index = model_dir / "model.safetensors.index.json"
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


_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
          "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")


_NO_INIT = threading.Lock()


@contextmanager
def _no_init():
    """Modules' reset_parameters() fill their new parameters at construction: on meta
    tensors there is nothing to fill, yet a random fill of one runs through torch's
    reference kernels, whose first use imports torch._dynamo: a second of every worker's
    start on two cores, for nothing. The weights come from the checkpoint.

    The fills are torch.nn.init's, process-wide: the lock keeps two threads that build
    models at once (a prefill and a decode service in one process) from saving each
    other's stand-ins as the originals."""
    with _NO_INIT:
        saved = {n: getattr(torch.nn.init, n) for n in _INITS}
        for n in _INITS:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for n, f in saved.items():
                setattr(torch.nn.init, n, f)


def build_empty(cfg, dtype: torch.dtype, device: str | torch.device, num_slots: int | None = None):
    """Allocate the model's parameters without initialising them."""
    v4 = cfg.model_type == "deepseek_v4"
    with torch.device("meta"), _default_dtype(dtype), _no_init():
        model = DeepseekV4ForCausalLM(cfg, num_slots) if v4 else DeepseekForCausalLM(cfg, num_slots)
    model.to_empty(device=device)
    model.fuse_projections()  # the checkpoint loads into the fused weights
    if v4:  # rotary tables are computed, not loaded
        model.ropes["main"] = Rope(cfg.rope_main, cfg.qk_rope_head_dim).to(device)
        model.ropes["compress"] = Rope(cfg.rope_compress, cfg.qk_rope_head_dim).to(device)
    else:
        model.rope = RotaryEmbedding(cfg).to(device)
    return model


def _computed(name: str) -> bool:
    return name in ("rope.cos", "rope.sin") or name.startswith("ropes.")


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
    v4 = cfg.model_type == "deepseek_v4"
    try:
        quant = QuantSpec.from_config(cfg.raw, str(model_dir / "config.json")) if v4 else None
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    weight_map = _weight_map(model_dir)
    files = weight_files(model_dir, weight_map)
    names_by_file = {f: _tensor_names(f) for f in files}
    file_of = _file_of(model_dir, names_by_file, weight_map)
    names = V4Names() if v4 else V3Names(cfg.num_hidden_layers)
    skip = {n for n in file_of if v4 and is_scale(n) and _weight_of_scale(n) in file_of}  # read with their weight
    resolved = {n: names.resolve(n) for n in file_of if n not in skip}

    if cfg.has_mtp and not any(t is not None and t.param.startswith("mtp.") for t in resolved.values()):
        log.warning("%s: config asks for an MTP layer but the checkpoint has none; speculative decoding is off", model_dir)
        cfg = replace(cfg, num_nextn_predict_layers=0)

    model = build_empty(cfg, dtype, device, num_slots)
    slots_of = expert_slots or (lambda layer: list(range(cfg.n_routed_experts)))
    state = dict(model.named_parameters())
    state.update({n: b for n, b in model.named_buffers() if not _computed(n)})
    targets = check_all(resolved, file_of, set(state), cfg)
    pending: dict[str, set] = {n: _pieces(n, t) for n, t in state.items()}

    for f in files:
        try:
            with SafetensorsFile(f) as sf:
                for name in names_by_file[f]:
                    if name in skip:
                        continue
                    target = targets[name]
                    dest = state[target.param]
                    src = _Source(sf, f.name, name, file_of, quant if v4 else None, dest.dtype)
                    if is_experts(target.param):
                        layer = _layer_of(target.param, cfg.num_hidden_layers)
                        _copy_experts(dest, target, slots_of(layer), cfg.n_routed_experts, src,
                                      pending[target.param])
                    elif target.param.endswith(".mlp.gate.tid2eid"):
                        _copy_hash_table(dest, src, sf.tensors[name].dtype, cfg)
                        _mark(pending, target)
                    else:
                        _copy(dest, src)
                        _mark(pending, target)
        except SafetensorsFormatError as e:
            raise CheckpointError(f"{model_dir}/{e}") from None
        except OSError as e:
            raise CheckpointError(f"{f}: could not read ({e})") from None

    _tie_optional(model, pending, cfg)
    missing = sorted(n for n, left in pending.items() if left)
    if missing and v4:  # say it in the checkpoint's own names too
        missing = [f"{n} (upstream {local_to_upstream(n, cfg.n_routed_experts)[0]})" for n in missing]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{model_dir}: missing tensors {', '.join(missing[:5])}{more}")
    model.eval().requires_grad_(False)
    unfuse_moved(model)
    return model


def _file_of(model_dir: Path, names_by_file: dict[Path, list[str]], weight_map: dict[str, str] | None) -> dict[str, Path]:
    """tensor name -> the file holding it; a name in two files, or an index that puts a
    tensor in a file without it, is a corrupt checkpoint."""
    file_of: dict[str, Path] = {}
    for f, names in names_by_file.items():
        for n in names:
            other = file_of.setdefault(n, f)
            if other != f:
                raise CheckpointError(f"{model_dir}: tensor {n!r} is stored twice, in {other.name} and {f.name}")
    for n, fname in (weight_map or {}).items():
        if n not in file_of or file_of[n].name != fname:
            raise CheckpointError(f"{model_dir / 'model.safetensors.index.json'}: lists tensor {n!r} in {fname}, "
                                  f"which does not hold it")
    return file_of


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


class _Source:
    """One tensor as it will land in a parameter: read as stored, or dequantized from
    FP8 / FP4 with its scale (found by name, in whichever file holds it)."""

    def __init__(self, sf: SafetensorsFile, fname: str, name: str, file_of: dict[str, Path],
                 quant: QuantSpec | None, dtype: torch.dtype):
        self.sf, self.fname, self.name, self.dtype = sf, fname, name, dtype
        info = sf.tensors[name]
        self.scale = None
        if quant is not None:
            self.scale = next((n for n in scale_names(name) if n in file_of), None)
        self.file_of, self.quant = file_of, quant
        self.fp4 = self.scale is not None and info.dtype in (torch.int8, torch.uint8)
        if self.scale is not None and not self.fp4 and info.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{fname}: tensor {name!r} has a scale but is stored as {info.dtype}, "
                                  f"not FP8 e4m3 or packed FP4")
        packed = info.dtype in (torch.int8, torch.uint8) and dtype.is_floating_point
        if self.scale is None and (info.dtype == torch.float8_e4m3fn or packed):
            raise CheckpointError(f"{fname}: tensor {name!r} is stored quantized ({info.dtype}) but its scale "
                                  f"({' or '.join(scale_names(name))}) is missing")
        self.shape = (*info.shape[:-1], 2 * info.shape[-1]) if self.fp4 else info.shape

    def _dequant(self) -> torch.Tensor:
        with SafetensorsFile(self.file_of[self.scale]) as ssf:
            scale = ssf.read(self.scale)
        w = self.sf.read(self.name)
        try:
            if self.fp4:
                return dequant_fp4(w, scale, self.dtype)
            return dequant_fp8_block(w, scale, self.quant.block, self.dtype)
        except ValueError as e:
            raise CheckpointError(f"{self.fname}: tensor {self.name!r}: {e}") from None

    def read_into(self, dest: torch.Tensor) -> None:
        if self.scale is None:
            self.sf.read_into(self.name, dest)
        else:
            dest.copy_(self._dequant())

    def read_row_into(self, row: int, dest: torch.Tensor) -> None:
        if self.scale is not None:
            raise CheckpointError(f"{self.fname}: tensor {self.name!r}: quantized fused experts are not supported")
        self.sf.read_row_into(self.name, row, dest)


def _weight_of_scale(name: str) -> str:
    return name.removesuffix("_scale_inv") if name.endswith("_scale_inv") else name.removesuffix(".scale") + ".weight"


def _copy_experts(dest: torch.Tensor, target: Target, slots: list[int], num_experts: int, src: _Source,
                  pending: set) -> None:
    """Fill the local slots that hold the tensor's expert(s); others belong to other ranks."""
    shape, fname, name = src.shape, src.fname, src.name
    if target.slot is None:  # fused: [E, ...]
        if shape != (num_experts, *dest.shape[1:]):
            raise CheckpointError(
                f"{fname}: tensor {name!r} has shape {shape}, expected {(num_experts, *dest.shape[1:])}")
        with torch.no_grad():
            for s, e in enumerate(slots):
                src.read_row_into(e, dest[s])
        for s in range(len(slots)):
            pending.difference_update({(s, None), (s, "gate"), (s, "up")})
        return
    for s, e in enumerate(slots):
        if e != target.slot:
            continue
        view = dest[s]
        if target.part is not None:
            half = view.shape[0] // 2
            view = view[:half] if target.part == "gate" else view[half:]
        if tuple(view.shape) != tuple(shape):
            raise CheckpointError(f"{fname}: tensor {name!r} has shape {shape}, expected {tuple(view.shape)}")
        with torch.no_grad():
            src.read_into(view)
        pending.discard((s, target.part))


def _copy_hash_table(dest: torch.Tensor, src: _Source, stored, cfg) -> None:
    check_hash_table(src.fname, src.name, src.shape, stored, cfg)
    with torch.no_grad():
        src.read_into(dest)
    check_expert_ids(src.fname, src.name, int(dest.min()), int(dest.max()), cfg.n_routed_experts)


def _copy(dest: torch.Tensor, src: _Source) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise CheckpointError(f"{src.fname}: tensor {src.name!r} has shape {src.shape}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        src.read_into(dest)


def _mark(pending: dict[str, set], target: Target) -> None:
    pending[target.param].clear()


def _tie_optional(model, pending: dict[str, set], cfg) -> None:
    # The MTP layer reuses the target's embedding and head when a checkpoint omits its copies.
    for j, m in enumerate(model.mtp):
        if not hasattr(m, "embed_tokens"):  # V4's MTP layer has none of its own
            continue
        if pending.get(f"mtp.{j}.embed_tokens.weight"):
            m.embed_tokens.weight = model.model.embed_tokens.weight
            pending[f"mtp.{j}.embed_tokens.weight"].clear()
        if pending.get(f"mtp.{j}.shared_head.head.weight"):
            m.shared_head.head.weight = model.lm_head.weight
            pending[f"mtp.{j}.shared_head.head.weight"].clear()
    if cfg.tie_word_embeddings and pending.get("lm_head.weight"):
        model.lm_head.weight = model.model.embed_tokens.weight
        pending["lm_head.weight"].clear()
