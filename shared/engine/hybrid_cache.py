"""The paged cache of a DeepSeek-V4 engine: main rows per block, and window rings.

Layout (shared/model/v4/layout.py): `main` [num_blocks, main_width] holds, per block
and compressed layer, the compressed entries and index keys of the block's groups;
`window` [num_rings * ring_len, window_width] holds, per position, the sliding-window
keys and the compressor projections, for a sequence's last `ring_len` blocks only.
Blocks are allocated, shared and freed by the BlockManager exactly as for V2/V3; each
sequence that has blocks also holds one ring (BlockManager.take_ring), taken with its
first blocks and given back with its last.

A request's state travels (prefill -> decode, one flat buffer) as its main rows
followed by the window rows of the `carry` blocks that end at its last computed
position, oldest first; the receiver files them into its own ring by block index.
"""

from __future__ import annotations

import torch

from shared.model.v4.config import V4Config
from shared.model.v4.layout import V4Layout


def ring_len_for(cfg: V4Config, block_size: int, num_spec: int) -> int:
    """Blocks in a ring: enough that a step's reads (lookback positions back) are never
    overwritten by positions written since, drafts included (2 * num_spec ahead)."""
    return (cfg.lookback + 2 * num_spec) // block_size + 2


def carry_for(cfg: V4Config, block_size: int) -> int:
    """Window blocks a request needs to continue from any position: those of its last
    `lookback` positions."""
    return (max(cfg.lookback, 1) - 1) // block_size + 2


class HybridKVCache:
    def __init__(self, cfg: V4Config, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 num_rings: int, ring_len: int):
        self.layout = V4Layout(cfg, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ring_len, self.num_rings = ring_len, num_rings
        self.carry = carry_for(cfg, block_size)
        if self.carry > ring_len:
            raise ValueError(f"ring of {ring_len} blocks cannot carry {self.carry}")
        self.main = torch.zeros(num_blocks, self.layout.main_width, dtype=dtype, device=device)
        self.window = torch.zeros(num_rings * ring_len, self.layout.window_width, dtype=dtype, device=device)

    @property
    def forward_arg(self) -> "HybridKVCache":
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.main.dtype

    @staticmethod
    def bytes_per_block(cfg: V4Config, block_size: int, dtype: torch.dtype) -> int:
        return V4Layout(cfg, block_size).main_width * dtype.itemsize

    # ---- a request's state as one buffer --------------------------------------------
    def export_numel(self, n_blocks: int) -> int:
        return n_blocks * self.layout.main_width + self.carry * self.layout.window_width

    def export_shape(self, n_blocks: int) -> tuple[int, ...]:
        return (self.export_numel(n_blocks),)

    def _carried(self, ring: list[int], num_computed: int) -> tuple[list[int], list[int]]:
        """(positions in the carry order that hold blocks, their ring rows)."""
        last = (num_computed - 1) // self.block_size
        idx, rows = [], []
        for i, j in enumerate(range(last - self.carry + 1, last + 1)):
            if j >= 0:
                idx.append(i)
                rows.append(ring[j % self.ring_len])
        return idx, rows

    def export(self, block_ids: list[int], ring: list[int], num_computed: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        n = len(block_ids)
        if out is None:
            out = torch.zeros(self.export_numel(n), dtype=self.dtype, device=self.main.device)
        mw = n * self.layout.main_width
        out[:mw].view(n, -1).copy_(self.main[torch.tensor(block_ids, device=self.main.device)])
        win = out[mw:].view(self.carry, -1)
        idx, rows = self._carried(ring, num_computed)
        win.zero_()
        if rows:
            win[torch.tensor(idx)] = self.window[torch.tensor(rows, device=self.window.device)].to(win.device)
        return out

    def import_(self, block_ids: list[int], ring: list[int], num_computed: int, buf: torch.Tensor) -> None:
        n = len(block_ids)
        if buf.dim() != 1 or buf.numel() != self.export_numel(n):
            raise ValueError(f"V4 state buffer has shape {tuple(buf.shape)}, expected ({self.export_numel(n)},) "
                             f"for {n} blocks")
        mw = n * self.layout.main_width
        self.main[torch.tensor(block_ids, device=self.main.device)] = buf[:mw].view(n, -1).to(self.main)
        idx, rows = self._carried(ring, num_computed)
        if rows:
            win = buf[mw:].view(self.carry, -1)
            self.window[torch.tensor(rows, device=self.window.device)] = win[torch.tensor(idx)].to(self.window)
