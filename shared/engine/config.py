"""Engine settings: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moemesh.shared.config.common import WorkerConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROLES = ("both", "prefill", "decode")
GRAPH_MODES = ("auto", "on", "eager", "off")  # see decode_graphs.py


@dataclass(frozen=True)
class EngineConfig:
    model: str
    role: str = "both"
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size from kv_cache_memory_mb
    kv_cache_memory_mb: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_speculative_tokens: int | None = None  # None: 1 when the checkpoint has an MTP layer, else 0
    seed: int = 0
    num_threads: int | None = None
    enable_prefix_caching: bool = True  # reuse KV of prompt prefixes computed before
    num_prefix_snapshots: int | None = None  # DeepSeek-V4: boundary snapshots kept (None: max_num_seqs)
    decode_graphs: str = "auto"  # decode_graphs.py: auto (CUDA graphs on a GPU), on, eager, off
    overlap_mtp: bool = True  # MTP steps planned while the one before runs (spec_overlap.py); False: whole steps
    overlap_lockstep: bool = True  # a lockstep rank's steps without MTP planned likewise; False: whole steps

    @classmethod
    def for_worker(cls, cfg: WorkerConfig, role: str) -> EngineConfig:
        """A worker's engine, from its service settings. Built here rather than in the
        service config so that config stays importable without torch (the gateway)."""
        return cls(
            model=cfg.model, role=role, dtype=cfg.dtype, device=cfg.device, block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks or None, kv_cache_memory_mb=cfg.kv_cache_memory_mb,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len or None,
            num_speculative_tokens=None if cfg.num_speculative_tokens < 0 else cfg.num_speculative_tokens,
            num_threads=cfg.num_threads or None, enable_prefix_caching=cfg.enable_prefix_caching,
            num_prefix_snapshots=None if cfg.num_prefix_snapshots < 0 else cfg.num_prefix_snapshots,
            decode_graphs=cfg.decode_graphs, overlap_mtp=cfg.overlap_mtp,
            overlap_lockstep=cfg.overlap_lockstep,
        )

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= 8:
            raise ValueError("num_speculative_tokens must be in [0, 8]")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_prefix_snapshots is not None and self.num_prefix_snapshots < 0:
            raise ValueError("num_prefix_snapshots must be >= 0")
        if self.decode_graphs not in GRAPH_MODES:
            raise ValueError(f"decode_graphs must be one of {GRAPH_MODES}, got {self.decode_graphs!r}")
        if self.decode_graphs == "on" and not self.device.startswith("cuda"):
            raise ValueError(f"decode_graphs = 'on' captures CUDA graphs and needs a CUDA device, not {self.device!r}"
                             " ('eager' runs the same static path on any device)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
