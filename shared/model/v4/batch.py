"""What a V4 forward needs to know about the batch, besides ForwardBatch's ids and positions.

Glossary:
- ctx index: rows [0, T) are the batch's own tokens (computed now); rows T.. are the
  *pre* positions, earlier positions read back from the sequences' rings (the window
  keys and compressor projections the batch needs from before its chunks). -1 means a
  position before 0.
- ring: a sequence's recent-position store; each region of it keeps position q at
  slot q % span (layout.py), so a (ring, position) pair addresses every region.
- group: the `m` positions that pool into one compressed entry (entry w pools
  positions w*m .. w*m+m-1; with CSA's overlap also the m before them).
- entry address: (main block row, entry index within the block).

Decode rows (one per sequence, first in the batch) are computed together; each extend
chunk (several rows of one sequence) on its own, as in the MLA path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Groups:
    """Compression groups that complete in this batch, for one layer type."""

    idx: torch.Tensor  # [G, span] ctx indices of the group's positions (-1: before 0)
    pos: torch.Tensor  # [G] rope position of the entry (its group's first position)
    blk: torch.Tensor  # [G] where the entry goes
    slot: torch.Tensor  # [G]


@dataclass
class Entries:
    """Compressed entries the rows may attend to, for one layer type."""

    blk: torch.Tensor  # [R, E] addresses (R = decode rows, or 1 for an extend chunk)
    slot: torch.Tensor  # [R, E]
    visible: torch.Tensor  # [rows] how many entries each row may see: (t + 1) // m


@dataclass
class Extend:
    q_start: int
    q_len: int
    key_idx: torch.Tensor  # [q_len + W - 1] ctx indices of positions p-W+1 .. p+q_len-1
    entries: dict[str, Entries] = field(default_factory=dict)


@dataclass
class HybridMeta:
    pre_ring: torch.Tensor  # [Npre] ring and position of each pre position
    pre_pos: torch.Tensor
    write_ring: torch.Tensor  # [T] each row's ring, position, and the end of its chunk:
    write_pos: torch.Tensor  # a region keeps a row only if it is among the chunk's
    write_end: torch.Tensor  # last `span` positions (earlier ones would collide)
    num_decode: int
    dec_keys: torch.Tensor  # [Bd, W] ctx indices of each decode row's window keys
    dec_entries: dict[str, Entries] = field(default_factory=dict)
    groups: dict[str, Groups] = field(default_factory=dict)
    extends: list[Extend] = field(default_factory=list)

    def to(self, device) -> "HybridMeta":
        def mv(x):
            if isinstance(x, torch.Tensor):
                return x.to(device)
            if isinstance(x, (Groups, Entries, Extend)):
                for k, v in vars(x).items():
                    setattr(x, k, mv(v))
                return x
            if isinstance(x, dict):
                return {k: mv(v) for k, v in x.items()}
            if isinstance(x, list):
                return [mv(v) for v in x]
            return x

        for k, v in vars(self).items():
            setattr(self, k, mv(v))
        return self
