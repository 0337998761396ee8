"""Message types of the mesh's control plane (see subjects.py for who sends what), and
their codec: dataclasses <-> MessagePack, validated on decode; token ids and logprobs as
byte columns; a request's settings (SamplingParams), beside their wire form
(WireSampling); and whether a message's claimed sender is the one its subject names.

A request's first message (PrefillJob) carries everything about it; KVReady hands
the same to the decode worker once. After that, TokenBatch carries only what changed:
new token ids per request, once per engine step per gateway.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

import msgpack
import msgspec


# ---- the codec ---------------------------------------------------------------------------
# Typed messages on the wire: dataclasses <-> MessagePack, validated on decode.
#
# A message class is a dataclass whose fields are annotated with plain types: int,
# float, str, bytes, bool, None-able versions, list[...], dict[str, ...] and nested
# message classes. `decode(data, Cls)` checks every field against its annotation and
# raises ProtocolError with the field path on the first mismatch, so a handler never
# meets a KeyError or a wrong type deep inside its logic.
#
# msgspec does the encoding and the typed decoding (a map per message, its fields by
# name: the same bytes as msgpack.packb of the fields). For a 2048-token PrefillJob it
# takes 17 µs to encode and 55 µs to decode, against 89 and 273 µs for the compiled
# field walk that came before it. `from_plain` (a reply already unpacked) goes through
# msgspec's convert with the same rules.

T = TypeVar("T")


class ProtocolError(ValueError):
    """A message that does not match its schema; the text names the field."""


# Hot-path messages may register a compact codec (positional arrays, hand-checked), so
# a per-token message costs about a microsecond rather than a generic walk of its fields.
_CODECS: dict[type, tuple[Any, Any]] = {}


def register_codec(cls: type, to_plain, from_plain_fn) -> None:
    """to_plain(obj) -> msgpack-able value; from_plain_fn(raw) -> obj, raising ProtocolError."""
    _CODECS[cls] = (to_plain, from_plain_fn)


_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: Any) -> bytes:
    codec = _CODECS.get(type(msg))
    if codec is not None:
        return msgpack.packb(codec[0](msg), use_bin_type=True)
    return _ENCODER.encode(msg)


def decode(data: bytes, cls: type[T]) -> T:
    codec = _CODECS.get(cls)
    if codec is not None:
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated exception types
            raise ProtocolError(f"{cls.__name__}: not valid MessagePack ({type(e).__name__}: {e})") from None
        return codec[1](raw)
    try:
        return _typed_decoder(cls).decode(data)
    except msgspec.ValidationError as e:
        raise ProtocolError(_where(cls.__name__, e)) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"{cls.__name__}: not valid MessagePack ({e})") from None


def from_plain(raw: Any, cls: type[T], path: str = "") -> T:
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        raise ProtocolError(_where(path or getattr(cls, "__name__", str(cls)), e)) from None


@lru_cache(maxsize=None)
def _typed_decoder(cls: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(cls)


def _where(name: str, e: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.a[3]`" as "Msg.a[3]: expected int, got str"."""
    msg, sep, at = str(e).rpartition(" - at `")
    if not sep:
        msg, at = str(e), "$`"
    path = at.rstrip("`").removeprefix("$")
    msg = msg.replace("`", "")
    return f"{name}{path}: {msg[:1].lower()}{msg[1:]}"


# ---- tokens on the wire ------------------------------------------------------------------
# Tokens on the wire: token ids as little-endian int32 bytes, and the two logprob types.
#
# A TokenLogprob is what the sampler produces, what a TokenBatch carries and what the
# gateway formats for OpenAI's API; nothing converts it on the way. Ids are ints
# throughout and are checked as such on arrival. PromptLogprobs is the same for a whole
# prompt, by column: a prompt of thousands of tokens is a few arrays, not thousands of
# lists.

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
        if not (type(t) is int and _is_wire_num(v) and isinstance(ids, list) and isinstance(vals, list)
                and all(type(x) is int for x in ids) and all(_is_wire_num(x) for x in vals)):
            raise TypeError(f"logprob of token {t!r}")
        if len(ids) != len(vals):
            raise ValueError(f"logprob of token {t}: {len(ids)} top ids but {len(vals)} logprobs")
        out.append(TokenLogprob(t, float(v), ids, [float(x) for x in vals]))
    return out


def _is_wire_num(v) -> bool:
    return type(v) is float or type(v) is int


# ---- a request's settings ----------------------------------------------------------------
# Per-request settings, validated once when the request arrives (and again on each worker,
# from WireSampling): how its tokens are sampled, and its priority class, which travels
# with them to every worker that serves it.

# Integers travel as MessagePack int64 and token ids as int32: a value beyond them would
# fail far from the request that sent it, so it is refused here.
INT64 = (-(1 << 63), (1 << 63) - 1)
INT32_MAX = (1 << 31) - 1


class SamplingParamError(ValueError):
    """A bad sampling parameter; `param` names it the way the OpenAI API spells it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


# A request's class (vLLM's `priority`): lower is served earlier, 0 is the default class.
# Bounded so that a value from a client stays a small integer wherever it travels; a
# thousand classes either side is more than any deployment names.
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000

GRAMMAR_KINDS = ("json_object", "json_schema", "lark")
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on what a request may generate, in a form no library owns: a JSON
    Schema (json_schema; json_object is any JSON object), or a Lark grammar (lark) such as
    the gateway writes for forced tool calls. Workers compile it (shared/grammar/)."""
    kind: str
    text: str = ""  # the schema as JSON text, or the grammar

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise SamplingParamError("response_format", f"grammar kind must be one of {GRAMMAR_KINDS}")
        if not isinstance(self.text, str) or len(self.text) > MAX_GRAMMAR_CHARS:
            raise SamplingParamError("response_format", f"a grammar is a string of at most {MAX_GRAMMAR_CHARS} "
                                                        f"characters")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n >= 0 = chosen token plus n alternatives
    # The prompt's own tokens scored (vLLM's prompt_logprobs), in the forward that computes
    # their KV: None = off; n >= 0 = each prompt token's logprob plus n alternatives.
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    grammar: GrammarSpec | None = None  # structured output: sampled tokens must keep to it
    # Its class: admission, the prefill queue and preemption go by (priority, arrival).
    priority: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        def need(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise SamplingParamError(param, msg)

        need(_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX, "max_tokens",
             f"must be an integer in [1, {INT32_MAX}]")
        need(_is_num(self.temperature) and 0 <= self.temperature <= 100, "temperature", "must be in [0, 100]")
        need(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(_is_int(self.top_k) and 0 <= self.top_k <= INT32_MAX, "top_k",
             f"must be an integer in [0, {INT32_MAX}] (0 disables it)")
        need(self.seed is None or (_is_int(self.seed) and INT64[0] <= self.seed <= INT64[1]), "seed",
             f"must be an integer in [{INT64[0]}, {INT64[1]}]")
        need(all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids",
             f"must be token ids in [0, {INT32_MAX}]")
        need(len(self.stop_token_ids) <= 1024, "stop_token_ids", "at most 1024 stop token ids")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        need(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
             "must be an integer in [0, 20]")
        need(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", "must be an integer in [0, 20]")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             "must be in [0, max_tokens]")
        need(_is_int(self.priority) and PRIORITY_MIN <= self.priority <= PRIORITY_MAX, "priority",
             f"must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is served earlier)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


# ---- the messages ------------------------------------------------------------------------
@dataclass
class WireSampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    # Structured output (GrammarSpec): "" = none. The spec, not a matcher's state, travels:
    # a worker that takes a request over (the decode side of a hand-off) rebuilds the state
    # by feeding the grammar the tokens generated so far.
    grammar_kind: str = ""
    grammar: str = ""
    prompt_logprobs: int | None = None  # the prefill worker scores the prompt (SamplingParams.prompt_logprobs)
    priority: int = 0  # the request's class (SamplingParams.priority); a sender without it means the default

    def to_params(self) -> SamplingParams:
        # Stop strings never reach workers: the gateway detokenizes and applies them.
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            logprobs=self.logprobs, min_tokens=self.min_tokens,
            grammar=GrammarSpec(self.grammar_kind, self.grammar) if self.grammar_kind else None,
            prompt_logprobs=self.prompt_logprobs, priority=self.priority,
        )

    @classmethod
    def from_params(cls, p: SamplingParams) -> "WireSampling":
        g = p.grammar
        return cls(p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, list(p.stop_token_ids), p.ignore_eos,
                   p.logprobs, p.min_tokens, g.kind if g else "", g.text if g else "", p.prompt_logprobs, p.priority)


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    sampling: WireSampling
    gateway_id: str
    decode_id: str  # the decode worker the gateway chose
    arrival_time: float = 0.0
    kv_sources: list["KVSource"] = field(default_factory=list)  # holders of longer cached prefixes
    # Parallel sampling: n > 1 forks the prompt into n requests of their own, named and
    # seeded by protocol/forks.py (fork_id, fork_params); request_id names only the job.
    n: int = 1


@dataclass
class KVLayout:
    """What both sides must agree on for a KV buffer to be meaningful."""

    num_layers: int
    block_size: int
    dim: int
    dtype: str
    model_fingerprint: str


@dataclass
class KVReadyItem:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # tokens already sampled on the prefill worker (at least one)
    sampling: WireSampling
    gateway_id: str
    lease_id: int
    num_blocks: int
    nbytes: int
    traceparent: str = ""  # the request's span on the prefill worker
    # MTP drafts for the first decode step: the prefill worker proposes them from the last
    # prompt position's hidden state, which the decode worker never has.
    draft_ids: list[int] = field(default_factory=list)
    forks: list["KVFork"] = field(default_factory=list)  # children whose KV moves with this one


@dataclass
class KVFork:
    """Parallel sampling: a child of the same prompt as its KVReadyItem (protocol/forks.py)
    whose KV moves with it. The item's buffer then holds the prompt's shared full blocks
    once, followed by the last block of the item's own request and of each fork, in order,
    and on DeepSeek-V4 then the ring look-back of each, in the same order
    (shared/engine/fork_io.py); num_blocks counts the blocks, nbytes all of it."""
    request_id: str
    output_ids: list[int]
    sampling: WireSampling
    traceparent: str = ""
    draft_ids: list[int] = field(default_factory=list)


@dataclass
class KVReady:
    """The requests whose prompts one prefill step finished, for one decode worker: it
    takes their KV in one transfer, posted before it replies (KVReadyReply)."""
    prefill_id: str
    prefill_address: bytes  # UCX worker address of the prefill worker
    layout: KVLayout
    items: list[KVReadyItem]
    lease_expires_in_s: float = 30.0
    # Unix time at which the prefill worker had the items' first tokens: the decode worker
    # measures the hand-off's dispatch from it (clocks of different hosts assumed in sync).
    first_token_at: float = 0.0


# KVReadyReply.refused's reason for a request the decode worker serves already, from another
# copy of its job (a job sent twice across a NATS outage can reach two prefill workers): the
# prefill worker with the other copy lets it go quietly; the request itself is fine.
ALREADY_SERVED = "already served here"


@dataclass
class KVReadyReply:
    """What the decode worker took, and where their bytes go: a receive posted under `tag`
    at `address` (its UCX worker address) for the KV of the items named in `expect`, laid
    end to end in that order. No tag: nothing is to be sent."""
    refused: dict[str, str] = field(default_factory=dict)  # request id -> why it was not taken
    address: bytes = b""
    tag: int = 0
    expect: list[str] = field(default_factory=list)  # items' request ids, in the order of their bytes
    traceparents: list[str] = field(default_factory=list)  # per expected item: its receive's span


@dataclass
class KVSendFailed:
    """A prefill worker will not send the bytes a KVReady's reply posted a receive for
    (tag): the decode worker fails that receive now rather than at its timeout."""
    prefill_id: str
    tag: int
    error: str


@dataclass
class KVRelease:
    request_id: str
    lease_id: int
    ok: bool = True


@dataclass
class Ack:
    ok: bool = True
    error: str = ""
    worker_id: str = ""  # who took it (a job sent to a queue group)


@dataclass
class ErrorReply:
    error: str
    code: str = "bad_request"


@dataclass
class TokenEnd:
    """What a row of a TokenBatch carries besides its ids."""
    row: int
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int | None = None  # with a request's first token: its prompt tokens found cached
    # with a request's first token, when it asked for them: its prompt's tokens, scored
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class TokenBatch:
    """One worker step's tokens for one gateway, by column: row i is request_ids[i], and its
    ids are the next counts[i] of token_ids (one each when counts is None). The few rows
    that end their request, fail it, or carry logprobs have an entry in `ends`.
    positions[i]: where row i's ids go in its request's output (the index of the first),
    so that the gateway sees a lost or repeated batch; empty when not known.
    handoffs: from a prefill worker, request id -> the decode worker its KV goes to when
    that is not the one the gateway chose (which did not answer); the gateway takes a
    request's rows only from the workers it knows serve it. Sent only when not empty."""
    request_ids: list[str]
    token_ids: list[int]
    counts: list[int] | None = None
    ends: list[TokenEnd] = field(default_factory=list)
    worker_id: str = ""
    sent_at: float = 0.0
    positions: list[int] = field(default_factory=list)
    handoffs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def error(cls, request_id: str, error: str, worker_id: str = "") -> "TokenBatch":
        return cls([request_id], [], [0], [TokenEnd(0, "error", error)], worker_id)  # no position: ends it wherever


def _batch_to_plain(b: TokenBatch) -> list:
    out = [b.sent_at, b.worker_id, b.request_ids, ids_to_wire(b.token_ids),
           None if b.counts is None else ids_to_wire(b.counts),
           [_end_to_plain(e) for e in b.ends], ids_to_wire(b.positions)]
    if b.handoffs:  # rare; without them a batch stays readable by a build before handoffs
        out.append(b.handoffs)
    return out


def _end_to_plain(e: TokenEnd) -> list:
    """[row, finish, error, logprobs], then [cached_tokens] when known, then the prompt's
    logprobs (after cached_tokens, null if need be) when there are any: an end without
    them reads as it did before they existed."""
    out = [e.row, e.finish_reason, e.error, None if e.logprobs is None else logprobs_to_plain(e.logprobs)]
    if e.cached_tokens is not None or e.prompt_logprobs is not None:
        out.append(e.cached_tokens)
    if e.prompt_logprobs is not None:
        out.append(prompt_logprobs_to_plain(e.prompt_logprobs))
    return out


_STR = {str}


def _batch_from_plain(raw) -> TokenBatch:
    """The compact form, checked column by column: this runs once per step per gateway."""
    try:
        sent_at, worker, rids, toks, counts, ends, *rest = raw  # a build before positions sends 6
        if len(rest) > 2:
            raise ValueError(f"{6 + len(rest)} fields")
        positions = rest[0] if rest else b""
        handoffs = rest[1] if len(rest) == 2 else {}
        if not (isinstance(handoffs, dict)
                and all(type(k) is str and type(v) is str for k, v in handoffs.items())):
            raise TypeError("handoffs")
        if not (isinstance(sent_at, (int, float)) and isinstance(worker, str) and isinstance(rids, list)
                and set(map(type, rids)) <= _STR and isinstance(ends, list)):  # C speed: 256 rows a step
            raise TypeError("header")
        token_ids = ids_from_wire(toks, "token_ids")
        if counts is None:
            if len(token_ids) != len(rids):
                raise ValueError(f"{len(rids)} rows but {len(token_ids)} token ids")
        else:
            counts = ids_from_wire(counts, "counts")
            if len(counts) != len(rids) or sum(counts) != len(token_ids) or min(counts, default=0) < 0:
                raise ValueError("counts do not match the rows and ids")
        positions = ids_from_wire(positions, "positions")
        if positions and (len(positions) != len(rids) or min(positions) < 0):
            raise ValueError("positions do not match the rows")
        out = []
        for row, finish, error, lps, *more in ends:  # more: [cached_tokens[, prompt logprobs]]
            cached = more[0] if more else None
            if not (type(row) is int and 0 <= row < len(rids) and (finish is None or isinstance(finish, str))
                    and (error is None or isinstance(error, str)) and len(more) <= 2
                    and (cached is None or (type(cached) is int and 0 <= cached <= INT32_MAX))):
                raise TypeError(f"end of row {row!r}")
            prompt = prompt_logprobs_from_plain(more[1]) if len(more) == 2 else None
            out.append(TokenEnd(row, finish, error, None if lps is None else logprobs_from_plain(lps), cached,
                                prompt))
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"TokenBatch: malformed ({e})") from None
    return TokenBatch(rids, token_ids, counts, out, worker, float(sent_at), positions, handoffs)


register_codec(TokenBatch, _batch_to_plain, _batch_from_plain)


@dataclass
class TokenResend:
    """Gateway -> worker: send these requests' ids again from these positions (a gap, a
    NATS outage, a stream gone silent); the answer comes as TokenBatches."""
    gateway_id: str
    request_ids: list[str]
    from_positions: list[int]


@dataclass
class Abort:
    request_ids: list[str]
    reason: str = "client"


@dataclass
class WorkerLoad:
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    outstanding_tokens: int = 0  # tokens still to generate for admitted requests
    pending_prompt_tokens: int = 0  # prompt tokens admitted but not computed yet


@dataclass
class Heartbeat:
    worker_id: str
    role: str  # prefill | decode | balancer | kv_store | gateway
    model: str
    load: WorkerLoad
    address: bytes = b""  # UCX worker address
    instance_id: str = ""
    dp_rank: int = 0
    dp_size: int = 1
    draining: bool = False
    # Its last beat: it goes now, without a drain (its engine can no longer step: a DEP peer
    # died); what it holds moves elsewhere at once, not after its beats have been missed.
    leaving: bool = False
    # A hand-off's KV pull to this decode worker failed lately (its data plane may be cut
    # while NATS still works): gateways send new requests to other decode workers first.
    handoffs_failing: bool = False
    started_at: float = 0.0  # unix time its process started: a later one is a restarted worker
    interval_s: float = 1.0
    sent_at: float = 0.0
    engine: str = "model"  # "mock" for the mock engine
    kv_identity: bytes = b""  # prefix_hash.kv_identity: whose block hashes match ours
    block_size: int = 0


@dataclass
class StatsRequest:
    detail: bool = False


@dataclass
class WorkerStats:
    worker_id: str
    role: str
    load: WorkerLoad
    num_held: int = 0  # prefill: requests whose KV waits for a pull
    num_transfers: int = 0  # decode: KV pulls in flight
    staging_bytes_used: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    # with StatsRequest(detail=True): recent steps as [unix time at end, total, forward, host, rank_wait,
    # serving-loop gap before the step] seconds, then the number of sequences in the step, the
    # exposed host seconds, the drafts accepted, and the slower ranks' device time the rank
    # waited for (a mock DEP rank's; 0 elsewhere)
    recent_steps: list[list[float]] = field(default_factory=list)
    placement_version: int = 0
    # gateway -> the requests this worker holds for it (queued, running, handed over, pulling):
    # what a dead gateway's clients can no longer read (`moemesh bench chaos` counts these orphans)
    requests_by_gateway: dict[str, int] = field(default_factory=dict)
    # with detail: the last requests' phases (PhaseLog, shared/service/runtime.py), as
    # [unix time at the last phase's end, seconds of each phase named in request_phases, in that order]
    request_phases: list[str] = field(default_factory=list)
    recent_requests: list[list[float]] = field(default_factory=list)


# ---- expert-parallel load balancing (balancer <-> the ranks of a DEP instance) ----------
@dataclass
class ExpertLoad:
    """A rank's token counts per MoE layer and logical expert over its recent window."""

    instance_id: str
    rank: int
    dp_size: int
    step: int
    window_steps: int
    layer_ids: list[int]  # MoE layer ids; ids >= num_target_layers are the MTP draft head's
    num_target_layers: int
    num_experts: int
    counts: bytes  # int64 little-endian [len(layer_ids), num_experts]
    slots_per_rank: int
    placement_version: int
    phy2log: bytes = b""  # int64 [len(layer_ids), dp_size * slots_per_rank], the placement in force

    def __post_init__(self):
        # The balancer sums these per rank and places experts by them: a report of the
        # wrong shape would fail there, or move experts on rows that mean nothing.
        if not 0 <= self.rank < self.dp_size:
            raise ValueError(f"rank {self.rank} is not in [0, dp_size={self.dp_size})")
        if self.num_experts < 1 or self.slots_per_rank < 1 or not self.layer_ids:
            raise ValueError("num_experts, slots_per_rank and layer_ids must be positive and non-empty")
        want = 8 * len(self.layer_ids) * self.num_experts
        if len(self.counts) != want:
            raise ValueError(f"counts is {len(self.counts)} bytes; {len(self.layer_ids)} layers of "
                             f"{self.num_experts} int64 counts are {want}")
        want = 8 * len(self.layer_ids) * self.dp_size * self.slots_per_rank
        if self.phy2log and len(self.phy2log) != want:
            raise ValueError(f"phy2log is {len(self.phy2log)} bytes; {len(self.layer_ids)} layers of "
                             f"{self.dp_size} x {self.slots_per_rank} int64 slots are {want}")


@dataclass
class MovePlan:
    instance_id: str
    move_id: int
    phy2log: bytes  # int64 [layers, P]: the new placement, all layers (unchanged rows included)
    num_layers: int
    base_version: int  # the placement the plan was computed against; stale plans are refused
    timeout_s: float = 30.0


@dataclass
class MoveStaged:
    instance_id: str
    move_id: int
    rank: int
    ok: bool
    error: str = ""
    bytes_received: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


@dataclass
class MoveCommit:
    instance_id: str
    move_id: int


@dataclass
class MoveAbort:
    instance_id: str
    move_id: int
    reason: str = ""


@dataclass
class MoveDone:
    instance_id: str
    move_id: int
    rank: int
    placement_version: int
    step: int
    switch_seconds: float = 0.0


@dataclass
class RebalanceRequest:
    """Ask the balancer to move an instance now: to `phy2log` if given, else to what the
    policy computes from current loads (ignoring the trigger thresholds)."""

    instance_id: str
    phy2log: bytes = b""
    num_layers: int = 0


@dataclass
class RebalanceReply:
    ok: bool
    error: str = ""
    move_id: int = 0
    ratio_before: float = 0.0
    ratio_after_expected: float = 0.0
    policy_seconds: float = 0.0
    move_seconds: float = 0.0
    bytes_moved: int = 0
    slots_changed: int = 0


# ---- KV blocks across the mesh (prefix reuse) ---------------------------------------------
@dataclass
class KVEvents:
    """Blocks a holder (worker or KV store) now has, or no longer has, by content hash."""

    holder_id: str
    role: str  # prefill | decode | kv_store
    kv_identity: bytes
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    reset: bool = False  # a full snapshot: forget what was known of this holder first


@dataclass
class KVSnapshotRequest:
    pass


@dataclass
class KVFetch:
    """Send these blocks (all of them, in order) to `address` under `tag`, or nothing.

    snapshot: DeepSeek-V4 blocks, which come with the boundary snapshot at the end of the
    last one, after them (shared/kv/spec.py); a store must be told, a worker knows.
    depth_only: send nothing; answer how many leading blocks could be sent (`num_blocks`:
    a V4 prefix can be sent only as deep as a boundary snapshot)."""

    hashes: list[bytes]
    address: bytes
    tag: int
    nbytes: int
    layout: KVLayout | None = None  # the fetcher's (shared/kv/spec.py); a worker checks it, a store holds by hash
    snapshot: bool = False
    depth_only: bool = False


@dataclass
class KVFetchReply:
    ok: bool
    error: str = ""
    checksums: list[int] = field(default_factory=list)  # per block, then the snapshot's (V4)
    num_blocks: int = 0  # the answer to depth_only


@dataclass
class KVPut:
    """Offer blocks to the KV store; it answers ready (with a tag) once its receive is set up."""

    holder_id: str
    hashes: list[bytes]
    checksums: list[int]  # per block, then the snapshot's
    nbytes: int
    kv_identity: bytes
    # DeepSeek-V4: the last snapshot_nbytes bytes are the boundary snapshot at the end of
    # hashes[-1], a record of its own in the store (prefix_hash.snapshot_key).
    snapshot_nbytes: int = 0


@dataclass
class KVPutReply:
    ok: bool
    tag: int = 0
    address: bytes = b""
    wanted: list[bool] = field(default_factory=list)  # which of the offered blocks (then the snapshot) it lacks
    error: str = ""


@dataclass
class KVSource:
    """Where the prefill worker can pull prompt blocks beyond its own cache from."""

    holder_id: str
    num_blocks: int  # blocks of the prompt's hash chain the holder has, from the start


# ---- the sender check --------------------------------------------------------------------
# Whether a message's claimed sender is the one its subject names.
#
# A heartbeat, a token batch and a KV event each say who sent them (worker_id, holder_id),
# and each travels on a subject that ends in that sender's id. NATS permissions bind a
# credential to its own subjects; this check binds the payload to the subject, so a worker
# that may publish only as itself cannot claim another's identity in the body either.


def sender_matches(obj: Any, subject: str) -> bool:
    """True when obj names no sender, or the sender its subject names.

    Args:
        obj: a decoded message.
        subject: the subject it arrived on (any prefix, dots included).
    Returns:
        False for a Heartbeat not on `*.heartbeat.{role}.{worker_id}`, a TokenBatch not
        on `*.tokens.{worker_id}`, or a KVEvents not on `*.kv.{holder_id}.events`.
    """
    parts = subject.split(".")
    if isinstance(obj, Heartbeat):
        return parts[-3:] == ["heartbeat", obj.role, obj.worker_id]
    if isinstance(obj, TokenBatch):
        return parts[-2:] == ["tokens", obj.worker_id]
    if isinstance(obj, KVEvents):
        return parts[-3:] == ["kv", obj.holder_id, "events"]
    return True
