"""Moving whole cached blocks in and out of an engine's paged cache, by content hash.

Used between engine steps only (the engine loop's ops): serving a peer's fetch,
importing blocks pulled from a peer or the KV store, and offering finished blocks to
the store. References are taken while blocks are read or filled, so eviction under
pressure never touches a block in use.

On the wire, blocks travel block-major (KVSpec.block_shape in shared/kv/spec.py): each
block's bytes are contiguous, so a holder can keep, checksum and serve them one by one.

Only the V2/V3 paged cache moves this way. A DeepSeek-V4 block is not self-contained:
the window rows a sequence needs to go on live in its ring, not in its blocks, and a V4
engine reuses a cached prefix only with a boundary snapshot of them (snapshots.py),
which does not travel with blocks yet; so V4 engines refuse to move blocks
(KVSpec.why_no_blocks) and reuse only their own cache.
"""

from __future__ import annotations

import zlib

import torch

from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.kv.spec import V4_NO_BLOCKS


def _paged(engine: LLMEngine) -> torch.Tensor:
    if engine.hybrid:
        raise ValueError(V4_NO_BLOCKS)
    return engine.kv.tensor


def acquire_prefix(engine: LLMEngine, hashes: list[bytes]) -> list[int]:
    """Blocks of the longest locally cached prefix of `hashes`, with a reference taken."""
    blocks = engine.blocks.lookup(hashes)
    engine.blocks.acquire(blocks)
    return blocks


def acquire_exact(engine: LLMEngine, hashes: list[bytes]) -> list[int] | None:
    """All of `hashes` with references taken, or None if any is missing."""
    blocks = engine.blocks.lookup(hashes)
    if len(blocks) != len(hashes):
        return None
    engine.blocks.acquire(blocks)
    return blocks


def allocate(engine: LLMEngine, n: int) -> list[int] | None:
    return engine.blocks.allocate(n) if engine.blocks.can_allocate(n) else None


def release(engine: LLMEngine, blocks: list[int]) -> None:
    if blocks:
        engine.blocks.free(blocks)


def gather(engine: LLMEngine, blocks: list[int], out: torch.Tensor) -> list[int]:
    """Copy blocks into `out` (block-major); returns each block's crc32."""
    _paged(engine)
    out.copy_(engine.kv.export_blocks(blocks).transpose(0, 1))
    return checksums(out)


def scatter_and_register(engine: LLMEngine, blocks: list[int], hashes: list[bytes], buf: torch.Tensor) -> None:
    """buf: block-major blocks, written into `blocks` and put into the prefix cache."""
    _paged(engine)
    engine.kv.import_blocks(blocks, buf.transpose(0, 1))
    for b, h in zip(blocks, hashes):
        engine.blocks.register(b, h)


def checksums(buf: torch.Tensor) -> list[int]:
    """crc32 of each block of a block-major buffer."""
    raw = buf.contiguous().view(buf.shape[0], -1).view(torch.uint8).numpy()
    return [zlib.crc32(row) for row in raw]
