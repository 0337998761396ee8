"""What one forward pass needs to know about the batch, built by the engine's runner.

Glossary:
- token: one row of the packed input; a batch is [T] tokens from many sequences.
- rowwise rows: the tokens of short chunks (a decode token, or one with the draft tokens
  to verify: at most ROWWISE_MAX, engine/runner.py); they come first in the batch, each
  attends to its own context (positions 0 .. its own) by the absorbed-weight MLA path,
  batched.
- extend sequence: a longer chunk (a prompt's); these follow and run the expanded MLA
  path, a sequence at a time.
- slot: a token's row in the paged cache, block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moemesh.shared.model.v4.batch import HybridMeta


@dataclass
class ExtendSeq:
    q_start: int  # first row of this sequence in the packed batch
    q_len: int  # tokens computed now
    ctx_len: int  # tokens attended to, the q_len new ones included
    ctx_slots: torch.Tensor  # [ctx_len] cache slots of positions 0..ctx_len-1


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each token's latent is written (V4: empty, see hybrid)
    num_decode: int = 0  # one-token chunks (the step's decode sequences), for its stats
    num_rowwise: int = 0  # MLA: rows attended one by one, first (decode rows and short chunks' rows)
    decode_block_tables: torch.Tensor | None = None  # [num_rowwise, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [num_rowwise]
    extends: list[ExtendSeq] = field(default_factory=list)
    queued_at: float = 0.0  # perf_counter time the step was queued for the device (0: when run)
    hybrid: "HybridMeta | None" = None  # DeepSeek-V4: window, compressor and entry addresses
    static: bool = False  # padded to a bucket of fixed shapes (engine/decode_graphs.py); num_decode: the real rows
    packed: torch.Tensor | None = None  # the one device buffer its int64 tensors are views of (runner.pack)
    row_keys: torch.Tensor | None = None  # [T] each row's sequence key (Sequence.key), for models that ask

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
