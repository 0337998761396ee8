"""What one forward pass needs to know about the batch, built by the engine's runner.

Glossary:
- token: one row of the packed input; a batch is [T] tokens from many sequences.
- decode sequence: contributes exactly one token and attends to its whole cached context;
  these come first in the batch and run the absorbed-weight MLA path, batched.
- extend sequence: contributes q_len >= 1 tokens (a prefill chunk, or the last token plus
  draft tokens to verify); these follow the decode tokens and run the expanded MLA path.
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
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [Bd]
    extends: list[ExtendSeq] = field(default_factory=list)
    queued_at: float = 0.0  # perf_counter time the step was queued for the device (0: when run)
    hybrid: "HybridMeta | None" = None  # DeepSeek-V4: window, compressor and entry addresses

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
