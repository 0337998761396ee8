"""The paged cache of a DeepSeek-V4 engine: main rows per block, and a ring per sequence.

Layout (shared/model/v4/layout.py): `main` [num_blocks, main_width] holds, per block
and compressed layer, the compressed entries and index keys of the block's groups;
`rings` [num_rings, ring_width] hold, per sequence, the recent positions' window keys
and compressor projections, position q at slot q % span of each region. Blocks are
allocated, shared and freed by the BlockManager exactly as for V2/V3; each sequence
that has blocks also holds one ring (BlockManager.take_ring), taken with its first
blocks and given back with its last.

A request's state travels (prefill -> decode, one flat buffer) as its main rows
followed by, per ring region, the `lookback` positions before its first position to
compute, oldest first (zeros before position 0); the receiver files them into its own
ring. That is everything a step needs to go on from there. Children of one prompt
(engine/fork_io.py) move as one such buffer with a carry per child: n main rows, then
the children's carries in order (`num_carries`).

With prefix caching, `num_snapshots` more rings follow the sequences' ones: the prefix
cache's boundary snapshots (shared/engine/snapshots.py), copied whole from and into
sequences' rings (`copy_rings`).
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.host_copy import to_device
from moemesh.shared.model.v4.config import V4Config
from moemesh.shared.model.v4.layout import V4Layout


class HybridKVCache:
    def __init__(self, cfg: V4Config, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 num_rings: int, num_spec: int, num_snapshots: int = 0):
        """num_snapshots: rings after the sequences' ones, for the prefix cache's boundary
        snapshots (shared/engine/snapshots.py)."""
        self.layout = V4Layout(cfg, block_size, num_spec)
        self.num_blocks, self.block_size, self.num_rings = num_blocks, block_size, num_rings
        # The last block and ring are scratch, owned by no sequence: a static decode batch's
        # padding rows write there (decode_graphs.py).
        self.scratch_block, self.scratch_ring = num_blocks, num_rings + num_snapshots
        self.main = torch.zeros(num_blocks + 1, self.layout.main_width, dtype=dtype, device=device)
        self.rings = torch.zeros(num_rings + num_snapshots + 1, self.layout.ring_width, dtype=dtype, device=device)

    @property
    def forward_arg(self) -> "HybridKVCache":
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.main.dtype

    @staticmethod
    def bytes_per_block(cfg: V4Config, block_size: int, dtype: torch.dtype) -> int:
        return V4Layout(cfg, block_size).main_width * dtype.itemsize

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """(source, destination) blocks' main rows: a forked child's copy of its parent's
        partial last block (engine/fork.py)."""
        src, dst = (to_device(x, torch.long, self.main.device) for x in zip(*pairs))
        self.main[dst] = self.main[src]

    def copy_rings(self, pairs: list[tuple[int, int]]) -> None:
        """(source, destination) rings: take or restore boundary snapshots, or give forked
        children their parent's state. A whole ring moves: slot q % span means the same
        position in both."""
        src, dst = (to_device(x, torch.long, self.rings.device) for x in zip(*pairs))
        self.rings[dst] = self.rings[src]

    # ---- a request's state as one buffer --------------------------------------------
    def export_numel(self, n_blocks: int, num_carries: int = 1) -> int:
        return n_blocks * self.layout.main_width + num_carries * self.layout.carry_width

    def export_shape(self, n_blocks: int, num_carries: int = 1) -> tuple[int, ...]:
        return (self.export_numel(n_blocks, num_carries),)

    def _carried(self, region, num_computed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the region's carry that hold positions, their positions)."""
        q = torch.arange(num_computed - region.lookback, num_computed)
        keep = q >= 0
        return keep.nonzero().flatten(), q[keep]

    def export(self, block_ids: list[int], ring: int, num_computed: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        n, lay = len(block_ids), self.layout
        if out is None:
            out = torch.empty(self.export_numel(n), dtype=self.dtype, device=self.main.device)
        mw = n * lay.main_width
        self.export_main(block_ids, out[:mw])
        self.export_carry(ring, num_computed, out[mw:])
        return out

    def export_main(self, block_ids: list[int], out: torch.Tensor) -> None:
        """The blocks' main rows, in order, into `out` (len(block_ids) * main_width elements)."""
        if block_ids:
            out.view(len(block_ids), -1).copy_(self.main[to_device(block_ids, torch.long, self.main.device)])

    def export_carry(self, ring: int, num_computed: int, out: torch.Tensor) -> None:
        """Each ring region's look-back before position num_computed, oldest first, into
        `out` (carry_width elements)."""
        off = 0
        for r in self.layout.rings:
            part = out[off : off + r.lookback * r.width].view(r.lookback, r.width)
            off += r.lookback * r.width
            rows, q = self._carried(r, num_computed)
            part.zero_()
            if len(q):
                part[rows.to(part.device)] = r.view(self.rings)[ring, (q % r.count).to(self.rings.device)].to(part)

    def import_(self, block_ids: list[int], ring: int, num_computed: int, buf: torch.Tensor) -> None:
        n, lay = len(block_ids), self.layout
        if buf.dim() != 1 or buf.numel() != self.export_numel(n):
            raise ValueError(f"V4 state buffer has shape {tuple(buf.shape)}, expected ({self.export_numel(n)},) "
                             f"for {n} blocks")
        mw = n * lay.main_width
        self.import_main(block_ids, buf[:mw])
        self.import_carry(ring, num_computed, buf[mw:])

    def import_main(self, block_ids: list[int], buf: torch.Tensor) -> None:
        """File main rows (export_main's layout) into the blocks, in order."""
        if block_ids:
            self.main[to_device(block_ids, torch.long, self.main.device)] = buf.view(len(block_ids), -1).to(self.main)

    def import_carry(self, ring: int, num_computed: int, buf: torch.Tensor) -> None:
        """File a carry (export_carry's layout) into `ring` at the slots of its positions."""
        off = 0
        for r in self.layout.rings:
            part = buf[off : off + r.lookback * r.width].view(r.lookback, r.width)
            off += r.lookback * r.width
            rows, q = self._carried(r, num_computed)
            if len(q):
                r.view(self.rings)[ring, (q % r.count).to(self.rings.device)] = part[rows.to(part.device)].to(self.rings)
