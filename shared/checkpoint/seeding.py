"""One seed per tensor: a checkpoint's values do not depend on write order or sharding."""

from __future__ import annotations

import hashlib


def seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)
