"""Replaying a recorded trace: arrival times, lengths and which prompt blocks requests share.

A trace names each prompt block by a hash id; two requests that list the same id at the
same place share that block's tokens (the ids chain: a block's id stands for it and every
block before it). The replay makes a block's tokens from its id, so requests that share
ids share tokens exactly, and a prefix cache, KV-aware routing and a KV store see the
trace's own reuse, without its text.

Formats, told apart by their shape:
- Mooncake (kvcache-ai/Mooncake, FAST25-release/traces/*.jsonl): one JSON object a line,
  {"timestamp": ms, "input_length", "output_length", "hash_ids"}; 512-token blocks.
- kv-cache-tester (callanjfox/kv-cache-tester, traces/*.json): one session a file,
  {"block_size", "hash_id_scope", "requests": [{"t": s, "in", "out", "hash_ids", ...}]};
  a subagent is an entry {"t", "requests": [...]} whose requests are timed from its t.

Hash ids are scoped to their file: several files replay as concurrent sessions that share
nothing, each starting at time 0.

Scaling: a trace recorded on a 128k-context model does not fit a 4,096-token one. A factor
F (a power of two that divides the block size) divides every length: a block of B tokens
becomes B/F tokens, so which blocks requests share, and so the hit rate, is unchanged.

Pure: files are read by `load`, nothing else does I/O.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK = 512


@dataclass(frozen=True)
class TraceRequest:
    t_s: float  # arrival, seconds from its file's start
    input_len: int
    output_len: int
    hash_ids: tuple[tuple[int, int], ...]  # (file index, id): a file's ids are its own


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]  # in arrival order
    block_size: int
    formats: tuple[str, ...]  # one per file

    @property
    def longest(self) -> int:
        """The most context any request needs: prompt plus output."""
        return max((r.input_len + r.output_len for r in self.requests), default=0)


def _int(v, what: str, where: str, low: int = 0) -> int:
    if type(v) is not int or v < low:
        raise ValueError(f"{where}: {what} must be an integer >= {low}, got {v!r}")
    return v


def _ids(v, where: str) -> list[int]:
    if not isinstance(v, list) or any(type(h) is not int for h in v):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    return v


def parse(text: str, source: str = "trace") -> tuple[str, int | None, list[tuple[float, int, int, list[int]]]]:
    """(format, its block size or None, [(t_s, input, output, hash ids)]) of one file's text."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None  # JSON lines, each an object
        if isinstance(doc, dict) and "requests" in doc:
            if not isinstance(doc["requests"], list):
                raise ValueError(f"{source}: 'requests' must be a list")
            bs = _int(doc.get("block_size"), "block_size", source, 1) if doc.get("block_size") is not None else None
            rows: list[tuple[float, int, int, list[int]]] = []
            _session(doc["requests"], 0.0, source, rows)
            if not rows:
                raise ValueError(f"{source}: no requests")
            return "kv-cache-tester", bs, rows
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{n}"
        try:
            r = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(r, dict):
            raise ValueError(f"{where}: each line must be an object")
        ts = r.get("timestamp")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
            raise ValueError(f"{where}: 'timestamp' must be a time in ms >= 0")
        rows.append((ts / 1e3, _int(r.get("input_length"), "input_length", where, 1),
                     _int(r.get("output_length"), "output_length", where, 0), _ids(r.get("hash_ids"), where)))
    if not rows:
        raise ValueError(f"{source}: no requests (Mooncake JSONL, or a kv-cache-tester JSON file)")
    return "mooncake", None, rows


def _session(reqs: list, start: float, where: str, rows: list) -> None:
    """A kv-cache-tester session's requests into rows. A subagent is an entry with requests
    of its own, timed from its start; its ids are the file's like the rest."""
    for i, r in enumerate(reqs):
        at = f"{where}: request {i}"
        if not isinstance(r, dict):
            raise ValueError(f"{at}: not an object")
        t = r.get("t")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"{at}: 't' must be a time in seconds >= 0")
        if isinstance(r.get("requests"), list) and "in" not in r:
            _session(r["requests"], start + t, f"{at} (subagent)", rows)
            continue
        rows.append((start + float(t), _int(r.get("in"), "'in'", at, 1), _int(r.get("out"), "'out'", at, 0),
                     _ids(r.get("hash_ids"), at)))


def load(paths: list[str | Path], block_size: int | None = None, limit: int | None = None) -> Trace:
    """The trace of one or more files, merged by arrival time.

    Args:
        block_size: tokens a hash id covers; None: each file's own (Mooncake's is 512).
        limit: keep the first `limit` requests by arrival.
    """
    if not paths:
        raise ValueError("no trace file given")
    formats, sizes, merged = [], set(), []
    for f, path in enumerate(paths):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read trace {path}: {getattr(e, 'strerror', None) or e}") from None
        fmt, own, rows = parse(text, str(path))
        formats.append(fmt)
        sizes.add(block_size or own or MOONCAKE_BLOCK)
        t0 = min(r[0] for r in rows)
        for k, (t, n_in, n_out, ids) in enumerate(rows):
            merged.append((t - t0, f, k, TraceRequest(t - t0, n_in, n_out, tuple((f, h) for h in ids))))
    if len(sizes) > 1:
        raise ValueError(f"the trace files have different block sizes ({sorted(sizes)}); "
                         "replay them apart, or give --trace-block-size")
    merged.sort(key=lambda x: x[:3])
    reqs = tuple(x[3] for x in merged)[: limit if limit else None]
    return Trace(reqs, sizes.pop(), tuple(formats))


def scale_for(trace: Trace, max_model_len: int | None) -> int:
    """The smallest power of two F that fits every request (prompt and output divided by F)
    into max_model_len and divides the block size; 1 when there is no limit."""
    if not max_model_len:
        return 1
    f = 1
    while True:
        if all(math.ceil(r.input_len / f) + math.ceil(r.output_len / f) <= max_model_len for r in trace.requests):
            return f
        if trace.block_size % (2 * f):
            raise ValueError(f"the trace needs {trace.longest} tokens of context; no factor that divides its "
                             f"{trace.block_size}-token blocks fits it into {max_model_len}")
        f *= 2


@dataclass(frozen=True)
class Replayed:
    """One request as sent: the prompt's token ids and max_tokens, after scaling."""
    t_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int
    trace_input_len: int  # before scaling
    implied_hit: int  # prompt tokens an unbounded prefix cache would hold when it arrives


def implied_hits(trace: Trace, factor: int = 1) -> list[int]:
    """Per request, the prompt tokens (after scaling) that earlier requests computed: its
    leading blocks whose ids came before, less the last prompt token, which a server must
    always compute to produce the first output token."""
    bt = trace.block_size // factor
    seen: set[tuple[int, int]] = set()
    out = []
    for r in trace.requests:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        out.append(max(0, min(k * bt, math.ceil(r.input_len / factor) - 1)))
        seen.update(r.hash_ids)
    return out


def replay(trace: Trace, factor: int, vocab: list[int], seed: int | str = 0) -> list[Replayed]:
    """The requests to send. A block's tokens are drawn from `vocab` by its id and the seed;
    a prompt is its blocks' tokens cut to its scaled length, and where the trace gives
    fewer blocks than the length needs, tokens of its own make up the rest."""
    if trace.block_size % factor:
        raise ValueError(f"a scale of {factor} does not divide the trace's {trace.block_size}-token blocks")
    if len(vocab) < 2:
        raise ValueError("the vocabulary to draw prompt tokens from is empty")
    bt = trace.block_size // factor
    blocks: dict[tuple[int, int], list[int]] = {}

    def block(h: tuple[int, int]) -> list[int]:
        if h not in blocks:
            rng = random.Random(f"moemesh-trace:{seed}:{h[0]}:{h[1]}")
            blocks[h] = [vocab[rng.randrange(len(vocab))] for _ in range(bt)]
        return blocks[h]

    hits = implied_hits(trace, factor)
    out = []
    for i, r in enumerate(trace.requests):
        n = math.ceil(r.input_len / factor)
        ids: list[int] = []
        for h in r.hash_ids:
            if len(ids) >= n:
                break
            ids.extend(block(h))
        if len(ids) < n:
            rng = random.Random(f"moemesh-trace:{seed}:tail:{i}")
            ids.extend(vocab[rng.randrange(len(vocab))] for _ in range(n - len(ids)))
        out.append(Replayed(r.t_s, tuple(ids[:n]), max(1, math.ceil(r.output_len / factor)), r.input_len, hits[i]))
    return out


def token_pool(tokenizer) -> list[int]:
    """The ids a replayed prompt may use: the tokenizer's vocabulary less its added and
    special tokens (an end-of-text id inside a prompt would change what a server does)."""
    added = set(tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.get_vocab_size(with_added_tokens=False)) if i not in added]


BAND_EDGES = (4096, 16384, 65536)


def band(n: int, edges: tuple[int, ...] = BAND_EDGES) -> str:
    """A context-length band by the trace's own length, e.g. "4k-16k"."""
    k = lambda x: f"{x // 1024}k"  # noqa: E731
    if n < edges[0]:
        return f"<{k(edges[0])}"
    for lo, hi in zip(edges, edges[1:]):
        if n < hi:
            return f"{k(lo)}-{k(hi)}"
    return f">={k(edges[-1])}"


def band_order(edges: tuple[int, ...] = BAND_EDGES) -> list[str]:
    return [band(0, edges), *(band(e, edges) for e in edges)]
