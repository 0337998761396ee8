"""Content addresses of KV blocks: a hash chain over the prompt's full blocks.

hash(block i) = H(hash(block i-1) || identity || token ids of block i), where identity
covers everything that makes two caches interchangeable: the model, the block size
and the cache dtype. Equal prefixes therefore have equal keys on every worker, in the
KV store and at the gateway, and a difference anywhere changes every later key.
"""

from __future__ import annotations

import hashlib
import json
import struct

ROOT = b"\x00" * 16
_SNAPSHOT = b"#snapshot"  # makes a key no block hash can be (those are 16 bytes)


def snapshot_key(h: bytes) -> bytes:
    """The KV store's key for the DeepSeek-V4 boundary snapshot at the end of block h."""
    return h + _SNAPSHOT


def is_snapshot_key(key: bytes) -> bool:
    return key.endswith(_SNAPSHOT)


def kv_identity(model_identity: dict, block_size: int, dtype: str) -> bytes:
    blob = json.dumps({"model": model_identity, "block_size": block_size, "dtype": dtype}, sort_keys=True,
                      default=str)
    return hashlib.blake2b(blob.encode(), digest_size=16).digest()


def block_hash(parent: bytes, tokens: list[int], identity: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(identity)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.digest()


def chain(tokens: list[int], block_size: int, identity: bytes, num_blocks: int | None = None,
          start: list[bytes] | None = None) -> list[bytes]:
    """Hashes of the first `num_blocks` full blocks (all full blocks by default).
    `start` continues an existing chain (the hashes of the first len(start) blocks)."""
    out = list(start or [])
    n = len(tokens) // block_size if num_blocks is None else min(num_blocks, len(tokens) // block_size)
    parent = out[-1] if out else ROOT
    for i in range(len(out), n):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size], identity)
        out.append(parent)
    return out
