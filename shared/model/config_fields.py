"""What every model family's config parser reads with: the error a config.json that
cannot be served raises, the RoPE settings, and a checked getter. Apart from config.py
(V2/V3, and the dispatch by model_type) so that v4/config.py builds on it without
importing the module that imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A config.json that moemesh cannot serve; the message names the file and key."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


class Getter:
    """A config.json's keys, read with a ConfigError that names the file and the key."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def int(self, key: str, default: int | None = None) -> int:
        v = self.raw.get(key, default)
        if v is None:
            raise ConfigError(f"{self.source}: missing required key {key!r}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{self.source}: {key} must be a non-negative integer, got {v!r}")
        return v

    def opt_int(self, key: str) -> int | None:
        v = self.raw.get(key)
        return None if v is None else self.int(key)
