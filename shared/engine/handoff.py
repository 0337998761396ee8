"""The prefill -> decode hand-off buffer of one request: its computed prefix's KV, out of
a prefill engine's cache and into a decode engine's.

A prefill engine holds a request after its first token (Admission.hold); export() gives
its blocks as one contiguous buffer of shape(n_blocks). A decode engine's import_()
files such a buffer into blocks (and on V4 a ring) of its own, which the request then
runs on as if its prompt had been computed here (Admission.run_prefilled). Children of
one prompt move together in one buffer (fork_io.py).
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.errors import NoCapacity, RequestError
from moemesh.shared.engine.hybrid_cache import HybridKVCache
from moemesh.shared.engine.kv_cache import KVCache
from moemesh.shared.engine.sequence import Sequence


class KVHandoff:
    def __init__(self, kv: KVCache | HybridKVCache, blocks: BlockManager, dtype: torch.dtype):
        self.kv, self.blocks, self.dtype = kv, blocks, dtype
        self.hybrid = isinstance(kv, HybridKVCache)

    def export(self, seq: Sequence, out: torch.Tensor | None = None) -> torch.Tensor:
        """The held sequence's computed prefix as one buffer of shape(n_blocks):
        [num_cache_layers, n_blocks, block_size, D] for MLA; for V4 the main rows and
        the window rows it needs to go on (hybrid_cache.py)."""
        n = self.blocks.blocks_for(seq.num_computed)
        if self.hybrid:
            return self.kv.export(seq.block_ids[:n], seq.ring, seq.num_computed, out)
        return self.kv.export_blocks(seq.block_ids[:n], out)

    def shape(self, n_blocks: int, num_carries: int = 1) -> tuple[int, ...]:
        """Shape of the buffer export fills for a prefix of n_blocks blocks. V4:
        num_carries sequences' ring look-backs after them (children moved together,
        engine/fork_io.py, carry one each); MLA carries nothing besides its blocks."""
        if self.hybrid:
            return self.kv.export_shape(n_blocks, num_carries)
        layers, _, bs, d = self.kv.tensor.shape
        return (layers, n_blocks, bs, d)

    def can_import(self, num_prompt_tokens: int) -> bool:
        if self.blocks.uses_rings and not self.blocks.num_free_rings:
            return False
        return self.blocks.can_allocate(self.blocks.blocks_for(num_prompt_tokens))

    def import_(self, num_prompt_tokens: int, kv: torch.Tensor) -> tuple[list[int], int]:
        """File a buffer of a prompt's KV into new blocks (V4: and a ring). Returns
        (block ids, ring or -1), whose references the caller hands to the request."""
        n_blocks = self.blocks.blocks_for(num_prompt_tokens)
        if tuple(kv.shape) != self.shape(n_blocks):
            raise RequestError(f"KV buffer has shape {tuple(kv.shape)}, {self.shape(n_blocks)} expected "
                               f"for {n_blocks} blocks")
        if not self.can_import(num_prompt_tokens):
            raise NoCapacity(f"{n_blocks} KV blocks needed, {self.blocks.num_free_blocks} free")
        block_ids, ring = self.blocks.allocate(n_blocks), -1
        try:
            if self.hybrid:
                ring = self.blocks.take_ring()
                self.kv.import_(block_ids, ring, num_prompt_tokens, kv)
            else:
                self.kv.import_blocks(block_ids, kv)
        except Exception:
            self.blocks.free(block_ids)
            if ring >= 0:
                self.blocks.give_ring(ring)
            raise
        return block_ids, ring
