"""Where a V4 layer keeps its cache: a block's *main* row and a *window* block's row.

A KV block covers `block_size` positions (a multiple of every compress rate, so a
block holds whole groups). Two kinds of storage:
- main rows, one per block, kept for the sequence's whole life: per CSA/HCA layer the
  compressed entries of the block's groups (`block_size / m` of them, head_dim wide),
  and per CSA layer the indexer's keys for those entries (index_head_dim wide);
- window rows, per position, kept only for a sequence's last few blocks (its *ring*):
  per layer (the MTP layer included) the sliding-window key (= value), and per CSA/HCA
  layer the compressor's projections of the token (kv and gate, for the group that is
  not complete yet and, with CSA's overlap, the one before it).
So the cache grows by `sum over compressed layers of width / m` per token, and a
sequence holds a constant window besides, whatever its length.

A layer's regions are column ranges of the flat rows; the views returned here index a
region as [rows, entries or positions, width] without copying.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.model.v4.config import CSA, SLIDING, V4Config


@dataclass(frozen=True)
class Region:
    offset: int  # first column in the flat row
    count: int  # entries (main) or positions (window) per block
    width: int

    @property
    def size(self) -> int:
        return self.count * self.width

    def view(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.offset : self.offset + self.size].view(rows.shape[0], self.count, self.width)


@dataclass(frozen=True)
class LayerRegions:
    layer_type: str
    rate: int  # 0 for sliding-only layers
    window_kv: Region
    entries: Region | None = None  # compressed entries (main)
    index_keys: Region | None = None  # indexer keys (main, CSA)
    proj: Region | None = None  # compressor kv|gate projections (window)
    index_proj: Region | None = None  # indexer compressor kv|gate projections (window, CSA)


class V4Layout:
    def __init__(self, cfg: V4Config, block_size: int):
        if block_size % cfg.block_multiple:
            raise ValueError(f"block_size {block_size} must be a multiple of every compress rate "
                             f"(lcm {cfg.block_multiple})")
        self.block_size = bs = block_size
        hd, ihd = cfg.head_dim, cfg.index_head_dim
        main = win = 0
        layers = []
        for i in range(cfg.num_cache_layers):
            t, m = cfg.layer_type(i), cfg.compress_rate(i)
            wkv = Region(win, bs, hd)
            win += wkv.size
            if t == SLIDING:
                layers.append(LayerRegions(t, 0, wkv))
                continue
            series = 2 if t == CSA else 1  # CSA's overlap: two series (Ca, Cb) per token
            ent = Region(main, bs // m, hd)
            main += ent.size
            proj = Region(win, bs, 2 * series * hd)
            win += proj.size
            idx = iproj = None
            if t == CSA:
                idx = Region(main, bs // m, ihd)
                main += idx.size
                iproj = Region(win, bs, 4 * ihd)
                win += iproj.size
            layers.append(LayerRegions(t, m, wkv, ent, idx, proj, iproj))
        self.layers = layers
        self.main_width = max(main, 1)  # a model of sliding layers only keeps nothing per block
        self.window_width = win

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        """What the cache grows by per position (main rows only)."""
        return self.main_width * dtype.itemsize / self.block_size

    def window_bytes(self, ring_blocks: int, dtype: torch.dtype) -> int:
        """What one sequence's ring holds, whatever its length."""
        return ring_blocks * self.window_width * dtype.itemsize
