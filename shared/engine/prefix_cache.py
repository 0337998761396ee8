"""The prefix cache as steps feed it: a sequence's full blocks registered under their
chain hashes (block_manager.py), and on DeepSeek-V4 the boundary snapshots that make a
cached prefix usable (snapshots.py).

A step's snapshots are planned with it (`restores`, `snapshot_plan`), copied on the
device after its forward, and filed once it has run (`unpin`, `file_snapshots`): an
operation between steps may take any snapshot ring that is not pinned.
"""

from __future__ import annotations

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.runner import Chunk
from moemesh.shared.engine.sequence import Sequence
from moemesh.shared.engine.snapshots import SnapshotCache, boundary
from moemesh.shared.protocol.prefix_hash import chain


class PrefixCache:
    def __init__(self, blocks: BlockManager, kv_identity: bytes, snapshots: SnapshotCache | None = None,
                 ahead: int = 0):
        """kv_identity: what a block's hash chain starts from (prefix_hash.kv_identity);
        ahead: V4, ring rows a step may write past a boundary it snapshots (V4Layout.ahead)."""
        self.blocks, self.block_size, self.kv_identity = blocks, blocks.block_size, kv_identity
        self.snapshots, self.ahead = snapshots, ahead

    def hashes(self, token_ids: list[int]) -> list[bytes]:
        """The chain hashes of the full blocks of token_ids."""
        return chain(token_ids, self.block_size, self.kv_identity)

    def register(self, seq: Sequence, through: int | None = None, pending: list[int] = ()) -> None:
        """Put the sequence's newly completed full blocks into the prefix cache. through:
        positions computed (default num_computed); `pending`: tokens whose KV is computed
        but that are not in seq.token_ids yet."""
        if not self.blocks.enable_caching:
            return
        n_full = (seq.num_computed if through is None else through) // self.block_size
        if n_full <= seq.num_registered:
            return
        tokens = seq.token_ids + list(pending) if pending else seq.token_ids
        seq.block_hashes = chain(tokens, self.block_size, self.kv_identity, n_full, seq.block_hashes)
        for i in range(seq.num_registered, n_full):
            self.blocks.register(seq.block_ids[i], seq.block_hashes[i])
        seq.num_registered = n_full

    # ---- V4 boundary snapshots --------------------------------------------------------
    def restores(self, chunks: list[Chunk]) -> list[tuple[int, int, bytes]]:
        """(snapshot, ring, hash) copies that must precede this step's forward: sequences
        that start on a cached prefix. The snapshots stay pinned until the step has run."""
        out = []
        for c in chunks:
            seq = c.seq
            if seq.restore_ring >= 0:
                out.append((seq.restore_ring, seq.ring, seq.restore_hash))
                seq.restore_ring, seq.restore_hash = -1, b""
        return out

    def unpin(self, restores: list[tuple[int, int, bytes]]) -> None:
        for _, _, h in restores:
            self.snapshots.unpin(h)

    def snapshot_plan(self, chunks: list[Chunk], ends: list[tuple[int, int]],
                      rings: list[int] | None = None) -> list[tuple[int, int, Sequence, int]]:
        """(ring, snapshot ring, sequence, boundary) copies to make after this step.
        ends: per chunk, positions computed and ring rows written up to (drafts included)."""
        out, bs, ahead = [], self.block_size, self.ahead
        for i, (c, (end, write_end)) in enumerate(zip(chunks, ends)):
            b = boundary(c.start, end, write_end, bs, ahead)
            if b and (dst := self.snapshots.take()) is not None:
                out.append((c.seq.ring if rings is None else rings[i], dst, c.seq, b))
        return out

    def file_snapshots(self, snaps: list[tuple[int, int, Sequence, int]]) -> None:
        """Snapshots taken: kept under the hash of the block ending at their boundary when
        that block is cached, else given back."""
        bs = self.block_size
        for _, dst, seq, b in snaps:
            i = b // bs - 1
            h = seq.block_hashes[i] if i < len(seq.block_hashes) else b""
            if not h or not self.blocks.lookup([h]):
                self.snapshots.give(dst)
                continue
            if not self.snapshots.put(h, dst, b):
                continue
            if b in seq.snap_targets:
                seq.snap_targets.remove(b)
            else:  # the newest boundary of its decode: it supersedes the one before
                if seq.latest_snap:
                    self.snapshots.demote(seq.latest_snap)
                seq.latest_snap = h
