"""The paged latent KV cache and its export/import as contiguous buffers.

Layout: [num_cache_layers, num_blocks + 1, block_size, kv_lora_rank + qk_rope_head_dim].
The MTP layer's cache is the last layer. The last block is scratch, owned by no
sequence: the padding rows of a static decode batch write there (decode_graphs.py). A request's export is the same layout
restricted to its blocks: [num_cache_layers, n, block_size, D], one contiguous buffer
that a transport can move as raw bytes.
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.host_copy import to_device
from moemesh.shared.kernels.kv_pack import kv_gather, kv_scatter
from moemesh.shared.model.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two for {cfg.model_type}, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.tensor = torch.zeros(
            cfg.num_cache_layers, num_blocks + 1, block_size, cfg.kv_cache_dim, dtype=dtype, device=device
        )

    @property
    def forward_arg(self) -> torch.Tensor:
        """What the model's forward takes as its cache."""
        return self.tensor

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return cfg.num_cache_layers * block_size * cfg.kv_cache_dim * dtype.itemsize

    def export_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        idx = to_device(block_ids, torch.long, self.tensor.device)
        return kv_gather(self.tensor, idx, out)

    def import_blocks(self, block_ids: list[int], buf: torch.Tensor) -> None:
        expect = (self.tensor.shape[0], len(block_ids), *self.tensor.shape[2:])
        if tuple(buf.shape) != expect:
            raise ValueError(f"KV buffer has shape {tuple(buf.shape)}, expected {expect}")
        idx = to_device(block_ids, torch.long, self.tensor.device)
        kv_scatter(self.tensor, idx, buf)
