"""What a worker's KV bytes are: one description, derived from the engine once, used by
every path that moves them (prefill -> decode hand-off, block fetch, the KV store).

Glossary:
- hand-off buffer: one request's computed prefix, as `engine.export_kv` fills it and
  `engine.add_prefilled` takes it: [layers, n, block_size, D] for an MLA cache; for a
  DeepSeek-V4 hybrid cache one flat buffer of n blocks' main rows plus the ring window
  the request carries (`carry`), whatever its length. Children of one prompt that move
  together (engine/fork_io.py) carry one window each.
- block-major buffer: whole cached blocks as they travel between caches and the store,
  [n, layers, block_size, D], each block's bytes contiguous. A DeepSeek-V4 move is a
  prefix's blocks and the boundary snapshot at its end, as one flat buffer laid out like
  a hand-off (n main rows, then the carry): a V4 prefix is usable only with it. The KV
  store keeps each block's rows and the snapshot as records of their own.
- wire form: `KVLayout`, the protocol message that carries a description between
  workers. Its values are those workers of older builds compare against.
- identity: `prefix_hash.kv_identity`, the part of every block hash that says whose
  blocks are interchangeable (model, block size, dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moemesh.shared.protocol.messages import KVLayout

@dataclass(frozen=True)
class KVSpec:
    fingerprint: str  # the model, as the wire form names it
    identity: bytes  # prefix_hash.kv_identity
    dtype: torch.dtype
    block_size: int
    num_layers: int  # cache layers (the MTP layer's included)
    dim: int  # MLA: a token row's width; V4: elements of a one-block hand-off buffer
    hybrid: bool  # a DeepSeek-V4 cache: main rows per block plus a ring per sequence
    block_numel: int  # elements one block adds to a hand-off buffer
    carry_numel: int = 0  # elements every V4 hand-off carries besides its blocks (ring window)

    @property
    def bytes_per_block(self) -> int:
        return self.block_numel * self.dtype.itemsize

    # ---- the hand-off buffer ------------------------------------------------------------
    def shape(self, num_blocks: int, num_carries: int = 1) -> tuple[int, ...]:
        """Shape of a hand-off buffer of num_blocks blocks for num_carries sequences
        (engine.kv_shape): one request, or children of one prompt moved together."""
        if self.hybrid:
            return (num_blocks * self.block_numel + num_carries * self.carry_numel,)
        return (self.num_layers, num_blocks, self.block_size, self.dim)

    def nbytes(self, num_blocks: int, num_carries: int = 1) -> int:
        return (num_blocks * self.block_numel + num_carries * self.carry_numel) * self.dtype.itemsize

    # ---- whole blocks ---------------------------------------------------------------------
    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of a block-major buffer of num_blocks blocks (V4: flat, the boundary
        snapshot after the blocks)."""
        if self.hybrid:
            return self.shape(num_blocks)
        return (num_blocks, self.num_layers, self.block_size, self.dim)

    def blocks_nbytes(self, num_blocks: int) -> int:
        if self.hybrid:
            return self.nbytes(num_blocks)
        return num_blocks * self.bytes_per_block

    def why_not_blocks(self, num_blocks: int, nbytes: int) -> str:
        """Why a request to move num_blocks blocks in nbytes bytes cannot be served, or ""."""
        want = self.blocks_nbytes(num_blocks)
        return "" if nbytes == want else f"size mismatch: {num_blocks} blocks are {want} bytes"

    # ---- between workers -----------------------------------------------------------------
    @property
    def wire(self) -> KVLayout:
        return KVLayout(self.num_layers, self.block_size, self.dim, _dtype_name(self.dtype), self.fingerprint)


def describe(engine) -> KVSpec:
    """The description of an engine's KV bytes, from the shapes its export fills."""
    cfg = engine.model_config
    fp = f"{cfg.model_type}:{cfg.hidden_size}x{cfg.num_hidden_layers}:{cfg.vocab_size}"
    one, none = math.prod(engine.kv_shape(1)), math.prod(engine.kv_shape(0))
    if engine.hybrid:
        # A V4 buffer is flat: its length could match between models that file their rows
        # differently (layer types, rates, widths), and the carried window only means
        # something to the model that wrote it. So the whole architecture must match.
        fp, layers, dim = f"{fp}:{engine.kv_identity.hex()}", cfg.num_cache_layers, one
    else:
        layers, _, _, dim = engine.kv_shape(1)
        fp = f"{fp}:{cfg.kv_lora_rank}"
    return KVSpec(fp, engine.kv_identity, engine.kv_dtype, engine.cfg.block_size, layers, dim, engine.hybrid,
                  one - none, none)


@dataclass(frozen=True)
class Compat:
    """The verdict of `compatible`: truthy when the bytes of one side mean the same to the other."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def compatible(mine: KVSpec | KVLayout, theirs: KVSpec | KVLayout) -> Compat:
    """Whether KV bytes described by `theirs` can be taken as they are by `mine`; when
    not, the reason names the first thing that differs."""
    a, b = (x.wire if isinstance(x, KVSpec) else x for x in (mine, theirs))
    for what, x, y in (("model", a.model_fingerprint, b.model_fingerprint), ("dtype", a.dtype, b.dtype),
                       ("block size", a.block_size, b.block_size), ("cache layers", a.num_layers, b.num_layers),
                       ("row width", a.dim, b.dim)):
        if x != y:
            return Compat(False, f"{what} differs: {x} here, {y} there")
    return Compat(True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
