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

The rows of decode chunks and of short chunks (a decode row with its MTP drafts), first
in the batch, are attended together, each with its own window keys and entries; each
longer extend chunk (prefill) on its own, its rows sharing the chunk's keys.
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
    """Compressed entries the rows may attend to, for one layer type: each sequence's
    block table, from which the device computes where entry e is (`addresses`), so
    that the host builds nothing that grows with the context."""

    table: torch.Tensor  # [R, blocks] block ids (R = decode rows, or 1 for an extend chunk)
    count: int  # entries the longest sequence has; the rows' addresses span 0 .. count-1
    visible: torch.Tensor  # [rows] how many entries each row may see: (t + 1) // m

    def addresses(self, per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(main block [R, count], entry slot [1, count]) of entries 0 .. count-1; past a
        sequence's own entries they point at what its table row holds there (masked)."""
        e = torch.arange(self.count, device=self.table.device)
        return self.table[:, e // per_block], (e % per_block)[None, :]


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
    num_decode: int  # rows attended one by one (decode rows, and the rows of short chunks), first
    dec_keys: torch.Tensor  # [Bd, W] ctx indices of each of those rows' window keys
    dec_entries: dict[str, Entries] = field(default_factory=dict)
    groups: dict[str, Groups] = field(default_factory=dict)
    extends: list[Extend] = field(default_factory=list)
    # Per ring span s (layout.py): where a region of that span reads and writes, so that
    # the forward indexes once per region and asks the device nothing.
    pre_slot: dict[int, torch.Tensor] = field(default_factory=dict)  # [Npre] pre_pos % s
    keep: dict[int, torch.Tensor] = field(default_factory=dict)  # rows a region keeps: among its chunk's last s
    keep_ring: dict[int, torch.Tensor] = field(default_factory=dict)  # their ring
    keep_slot: dict[int, torch.Tensor] = field(default_factory=dict)  # and slot, write_pos % s
