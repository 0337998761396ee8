"""Moving whole cached blocks in and out of an engine's paged cache, by content hash.

Used between engine steps only (the engine loop's ops): serving a peer's fetch,
importing blocks pulled from a peer or the KV store, and offering finished blocks to
the store. References are taken while blocks are read or filled, so eviction under
pressure never touches a block in use.

On the wire, blocks travel block-major (KVSpec.block_shape in shared/kv/spec.py): each
block's bytes are contiguous, so a holder can keep, checksum and serve them one by one.

A DeepSeek-V4 block is not self-contained: a sequence going on from its end also needs
the window rows of the positions before it, which live in a ring, and a V4 engine uses
a cached prefix only as deep as a boundary snapshot of them (snapshots.py). So a V4
prefix moves with the snapshot at its end: the holder serves blocks only when it has
that snapshot (pinned while it is read), the buffer carries it after the blocks (the
hand-off layout: n main rows, then each ring region's look-back, by position), and the
receiver files it into a snapshot ring of its own. One more checksum covers it.
"""

from __future__ import annotations

import zlib

import torch

from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.host_copy import to_device
from moemesh.shared.engine.snapshots import usable_depth


def acquire_prefix(engine: LLMEngine, hashes: list[bytes]) -> list[int]:
    """Blocks of the longest locally cached prefix of `hashes` that can be started on (V4:
    up to its deepest boundary snapshot), with a reference taken."""
    blocks = engine.blocks.lookup(hashes)
    blocks = blocks[: usable_depth(engine.snapshots, hashes[: len(blocks)], engine.hybrid)]
    engine.blocks.acquire(blocks)
    return blocks


def depth(engine: LLMEngine, hashes: list[bytes]) -> int:
    """How many leading blocks of `hashes` are cached here and can be served (V4: up to
    the deepest boundary snapshot among them)."""
    return usable_depth(engine.snapshots, hashes[: len(engine.blocks.lookup(hashes))], engine.hybrid)


def acquire_deepest(engine: LLMEngine, hashes: list[bytes]) -> list[int]:
    """acquire_exact of the leading `depth` blocks of `hashes` ([] if none)."""
    n = depth(engine, hashes)
    return (acquire_exact(engine, hashes[:n]) or []) if n else []


def acquire_exact(engine: LLMEngine, hashes: list[bytes]) -> list[int] | None:
    """All of `hashes` with references taken (V4: and the snapshot at their end, pinned),
    or None if any is missing. Give them back with release_exact."""
    blocks = engine.blocks.lookup(hashes)
    if len(blocks) != len(hashes):
        return None
    if engine.hybrid:
        if not engine.snapshots or not engine.snapshots.has(hashes[-1]):
            return None
        engine.snapshots.pin(hashes[-1])
    engine.blocks.acquire(blocks)
    return blocks


def release_exact(engine: LLMEngine, blocks: list[int], hashes: list[bytes]) -> None:
    if blocks:
        engine.blocks.free(blocks)
        if engine.hybrid:
            engine.snapshots.unpin(hashes[-1])


def allocate(engine: LLMEngine, n: int) -> list[int] | None:
    return engine.blocks.allocate(n) if engine.blocks.can_allocate(n) else None


def release(engine: LLMEngine, blocks: list[int]) -> None:
    if blocks:
        engine.blocks.free(blocks)


def gather(engine: LLMEngine, blocks: list[int], out: torch.Tensor, hashes: list[bytes] = ()) -> list[int]:
    """Copy blocks into `out` (block-major; V4: then the snapshot at the end of hashes[-1],
    which acquire_exact pinned); returns each block's crc32 (V4: and the snapshot's)."""
    if engine.hybrid:
        h = hashes[-1]
        engine.kv.export(blocks, engine.snapshots.ring(h), engine.snapshots.boundary(h), out)
        return checksums(out, engine.kv.layout.main_width, len(blocks))
    out.copy_(engine.kv.export_blocks(blocks).transpose(0, 1))
    return checksums(out)


def scatter_and_register(engine: LLMEngine, blocks: list[int], hashes: list[bytes], buf: torch.Tensor,
                         first_block: int = 0) -> None:
    """buf: block-major blocks, written into `blocks` and put into the prefix cache. V4:
    the snapshot after them goes into a snapshot ring of this engine, filed at the end of
    block first_block + len(blocks) - 1 of the prompt (its position is what files it)."""
    if engine.hybrid:
        n = len(blocks)
        main = engine.kv.main
        main[to_device(blocks, torch.long, main.device)] = buf[: n * engine.kv.layout.main_width].view(n, -1).to(main)
    else:
        engine.kv.import_blocks(blocks, buf.transpose(0, 1))
    for b, h in zip(blocks, hashes):
        engine.blocks.register(b, h)
    if engine.hybrid and engine.snapshots and (ring := engine.snapshots.take()) is not None:
        at = (first_block + len(blocks)) * engine.cfg.block_size
        engine.kv.import_carry(ring, at, buf[len(blocks) * engine.kv.layout.main_width :])
        engine.snapshots.put(hashes[-1], ring, at)


def checksums(buf: torch.Tensor, block_numel: int = 0, num_blocks: int = 0) -> list[int]:
    """crc32 of each block of a block-major buffer; of a flat V4 buffer (block_numel > 0),
    of each of its num_blocks main rows, then of the snapshot after them."""
    if not block_numel:
        raw = buf.contiguous().view(buf.shape[0], -1).view(torch.uint8).numpy()
        return [zlib.crc32(row) for row in raw]
    raw = buf.contiguous().view(torch.uint8).numpy()
    per = block_numel * buf.element_size()
    return [zlib.crc32(raw[i * per : (i + 1) * per]) for i in range(num_blocks)] + [zlib.crc32(raw[num_blocks * per :])]
