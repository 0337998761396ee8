"""Tokens on the wire: token ids as little-endian int32 bytes, and the two logprob types.

A TokenLogprob is what the sampler produces, what a TokenBatch carries and what the
gateway formats for OpenAI's API; nothing converts it on the way. Ids are ints
throughout and are checked as such on arrival. PromptLogprobs is the same for a whole
prompt, by column: a prompt of thousands of tokens is a few arrays, not thousands of
lists.
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


@dataclass(slots=True)
class PromptLogprobs:
    """A prompt's tokens as the model scores them, in the forward that computed their KV.

    P = prompt tokens, k = num_top. Token i (1 .. P-1) is scored by the distribution at
    position i-1; token 0 has nothing before it (OpenAI reports it as null), so every
    column has P-1 rows. ranks: 1 for the most likely token. top_ids and top_logprobs:
    the k most likely tokens of each row (most likely first), row after row."""
    num_top: int
    logprobs: list[float] = field(default_factory=list)  # [P-1]
    ranks: list[int] = field(default_factory=list)  # [P-1]
    top_ids: list[int] = field(default_factory=list)  # [(P-1) * k]
    top_logprobs: list[float] = field(default_factory=list)  # [(P-1) * k]

    @classmethod
    def empty(cls, num_prompt_tokens: int, num_top: int) -> "PromptLogprobs":
        """Columns of a prompt's size, to be filled chunk by chunk as the prompt is computed."""
        n = max(num_prompt_tokens - 1, 0)
        return cls(num_top, [0.0] * n, [0] * n, [0] * (n * num_top), [0.0] * (n * num_top))

    @property
    def num_rows(self) -> int:
        """P - 1: the prompt tokens scored."""
        return len(self.logprobs)

    def top(self, i: int) -> tuple[list[int], list[float]]:
        """Row i's most likely tokens and their logprobs (row i scores prompt token i + 1)."""
        k = self.num_top
        return self.top_ids[i * k : (i + 1) * k], self.top_logprobs[i * k : (i + 1) * k]


def prompt_logprobs_to_plain(p: PromptLogprobs) -> list:
    """[k, logprobs, ranks, top ids, top logprobs], the numbers as little-endian float32
    and int32 bytes: the engine computes them in float32, so nothing is lost."""
    return [p.num_top, _floats_to_wire(p.logprobs), ids_to_wire(p.ranks), ids_to_wire(p.top_ids),
            _floats_to_wire(p.top_logprobs)]


def prompt_logprobs_from_plain(raw) -> PromptLogprobs:
    """Raises TypeError or ValueError on anything malformed: columns of other lengths than
    the rows and num_top say, ranks below 1, ids below 0."""
    if not isinstance(raw, list) or len(raw) != 5:
        raise TypeError("prompt logprobs: expected [num_top, logprobs, ranks, top ids, top logprobs]")
    k, lps, ranks, top_ids, top_lps = raw
    if type(k) is not int or not 0 <= k <= 1024:
        raise ValueError(f"prompt logprobs: num_top {k!r}")
    out = PromptLogprobs(k, _floats_from_wire(lps, "prompt logprobs"), ids_from_wire(ranks, "prompt ranks"),
                         ids_from_wire(top_ids, "prompt top ids"), _floats_from_wire(top_lps, "prompt top logprobs"))
    n = len(out.logprobs)
    if len(out.ranks) != n or len(out.top_ids) != n * k or len(out.top_logprobs) != n * k:
        raise ValueError(f"prompt logprobs: columns do not match {n} rows of {k} alternatives")
    if min(out.ranks, default=1) < 1 or min(out.top_ids, default=0) < 0:
        raise ValueError("prompt logprobs: a rank below 1 or a negative token id")
    return out


def _floats_to_wire(vs: list[float]) -> bytes:
    return _to_wire("f", vs)


def _floats_from_wire(b: bytes, what: str) -> list[float]:
    return _from_wire("f", b, f"{what}: expected float32 bytes")


def ids_to_wire(ids: list[int]) -> bytes:
    return _to_wire("i", ids)


def ids_from_wire(b: bytes, what: str) -> list[int]:
    """Raises TypeError for anything but whole int32s (the caller names the message)."""
    return _from_wire("i", b, f"{what}: expected int32 bytes")


def _to_wire(code: str, vs: list) -> bytes:
    a = array(code, vs)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _from_wire(code: str, b: bytes, error: str) -> list:
    """Little-endian 4-byte items of array type `code`; TypeError(error) for anything else."""
    if not isinstance(b, bytes) or len(b) % 4:
        raise TypeError(error)
    a = array(code)
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
