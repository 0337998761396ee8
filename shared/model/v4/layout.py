"""Where a V4 layer keeps its cache: a block's *main* row, and a sequence's *ring*.

A KV block covers `block_size` positions (a multiple of every compress rate, so a
block holds whole groups). Two kinds of storage:
- main rows, one per block, kept for the sequence's whole life: per CSA/HCA layer the
  compressed entries of the block's groups (`block_size / m` of them, head_dim wide),
  and per CSA layer the indexer's keys for those entries (index_head_dim wide);
- a ring per sequence, holding the recent positions a step may read back: per layer
  (the MTP layer included) the sliding-window key (= value) of the last W-1 positions,
  and per CSA/HCA layer the compressor's projections (kv | gate) of the positions of
  a group not yet complete (with CSA's overlap, also the group before it). Each such
  region keeps exactly what it needs: position q sits at slot q % span, with span =
  its look-back plus the positions drafts may write ahead.
So the cache grows by `sum over compressed layers of width / m` per token, and a
sequence holds a constant ring besides, whatever its length.

A region is a column range of the flat rows; the views returned here index it as
[rows, entries or slots, width] without copying.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.shared.model.v4.config import CSA, SLIDING, V4Config


@dataclass(frozen=True)
class Region:
    offset: int  # first column in the flat row
    count: int  # entries per block (main) or slots per ring (span)
    width: int
    lookback: int = 0  # ring regions: positions before a step's first that it may read

    @property
    def size(self) -> int:
        return self.count * self.width

    def view(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.offset : self.offset + self.size].view(rows.shape[0], self.count, self.width)


@dataclass(frozen=True)
class LayerRegions:
    layer_type: str
    rate: int  # 0 for sliding-only layers
    window_kv: Region  # ring
    entries: Region | None = None  # compressed entries (main)
    index_keys: Region | None = None  # indexer keys (main, CSA)
    proj: Region | None = None  # compressor kv|gate projections (ring)
    index_proj: Region | None = None  # indexer compressor kv|gate projections (ring, CSA)

    def ring_regions(self) -> list[Region]:
        return [r for r in (self.window_kv, self.proj, self.index_proj) if r is not None]


class V4Layout:
    def __init__(self, cfg: V4Config, block_size: int, num_spec: int = 0):
        if block_size % cfg.block_multiple:
            raise ValueError(f"block_size {block_size} must be a multiple of every compress rate "
                             f"(lcm {cfg.block_multiple})")
        self.block_size = bs = block_size
        hd, ihd = cfg.head_dim, cfg.index_head_dim
        self.ahead = ahead = 2 * num_spec + 2  # drafts write past the last verified position
        main = ring = 0

        def ring_region(lookback: int, width: int) -> Region:
            nonlocal ring
            r = Region(ring, lookback + ahead, width, lookback)
            ring += r.size
            return r

        layers = []
        for i in range(cfg.num_cache_layers):
            t, m = cfg.layer_type(i), cfg.compress_rate(i)
            wkv = ring_region(cfg.sliding_window - 1, hd)
            if t == SLIDING:
                layers.append(LayerRegions(t, 0, wkv))
                continue
            overlap = t == CSA  # CSA's overlap: two series (Ca, Cb) per token, and the group before
            ent = Region(main, bs // m, hd)
            main += ent.size
            group_back = (2 * m if overlap else m) - 1
            proj = ring_region(group_back, 2 * (2 if overlap else 1) * hd)
            idx = iproj = None
            if overlap:
                idx = Region(main, bs // m, ihd)
                main += idx.size
                iproj = ring_region(group_back, 4 * ihd)
            layers.append(LayerRegions(t, m, wkv, ent, idx, proj, iproj))
        self.layers = layers
        self.main_width = max(main, 1)  # a model of sliding layers only keeps nothing per block
        self.ring_width = ring
        self.rings = [r for lr in layers for r in lr.ring_regions()]
        self.carry_width = sum(r.lookback * r.width for r in self.rings)

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        """What the cache grows by per position (main rows only)."""
        return self.main_width * dtype.itemsize / self.block_size

    def ring_bytes(self, dtype: torch.dtype) -> int:
        """What one sequence's ring holds, whatever its length."""
        return self.ring_width * dtype.itemsize
