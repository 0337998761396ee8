"""Tokens on the wire: token ids as little-endian int32 bytes, and the one logprob type.

A TokenLogprob is what the sampler produces, what a TokenBatch carries and what the
gateway formats for OpenAI's API; nothing converts it on the way. Ids are ints
throughout and are checked as such on arrival.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field

_SWAP = sys.byteorder != "little"


@dataclass(slots=True)
class TokenLogprob:
    """A sampled token's logprob under the model's raw distribution, and the most likely
    alternatives (most likely first), as OpenAI reports them."""
    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


def ids_to_wire(ids: list[int]) -> bytes:
    a = array("i", ids)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def ids_from_wire(b: bytes, what: str) -> list[int]:
    """Raises TypeError for anything but whole int32s (the caller names the message)."""
    if not isinstance(b, bytes) or len(b) % 4:
        raise TypeError(f"{what}: expected int32 bytes")
    a = array("i")
    a.frombytes(b)
    if _SWAP:
        a.byteswap()
    return a.tolist()


def logprobs_to_plain(lps: list[TokenLogprob]) -> list:
    return [[lp.token_id, lp.logprob, lp.top_ids, lp.top_logprobs] for lp in lps]


def logprobs_from_plain(raw) -> list[TokenLogprob]:
    """Raises TypeError or ValueError on anything malformed: ids must be ints (a float id
    is refused, not truncated), logprobs numbers, and both top lists equally long."""
    if not isinstance(raw, list):
        raise TypeError("logprobs: expected a list")
    out = []
    for item in raw:
        t, v, ids, vals = item
        if not (type(t) is int and _is_num(v) and isinstance(ids, list) and isinstance(vals, list)
                and all(type(x) is int for x in ids) and all(_is_num(x) for x in vals)):
            raise TypeError(f"logprob of token {t!r}")
        if len(ids) != len(vals):
            raise ValueError(f"logprob of token {t}: {len(ids)} top ids but {len(vals)} logprobs")
        out.append(TokenLogprob(t, float(v), ids, [float(x) for x in vals]))
    return out


def _is_num(v) -> bool:
    return type(v) is float or type(v) is int
