"""The request stream of `bench serve`: prompts of controlled length, output lengths and
arrival offsets, all drawn from seeded RNGs so the same config gives the same stream.

Glossary:
- session: a unit of work that runs its turns one after another. Every workload is a list
  of sessions; random, fixed and prefix workloads have sessions of exactly one turn.
- turn: one request. Turn 1 carries the whole first prompt; a later turn appends its
  `text` (a "tool output") to the context, which already holds the earlier prompts and
  the model's answers, so the context grows turn by turn (SemiAnalysis AgentX style).
- arrival: the start offset of a session in a unit-rate Poisson process; the runner
  divides it by the requested rate, so one stream serves every rate of a sweep.
- class: with a priority mix, a session's requests are all sent at one priority: the
  high class's value (`priority` in the body) for the mix's share of sessions, the
  default class (no field) for the rest. Which sessions are drawn from an RNG of their
  own, so a mix changes nothing else about the stream.

Lengths are counted in tokens of the server's tokenizer when one is given (`tokenizer.json`
loaded with `tokenizers`); otherwise a words-per-token estimate sets the number of words.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path

KINDS = ("random", "fixed", "prefix", "agentic", "dataset", "trace")

# Common English words: modern BPE vocabularies (32k-200k entries) encode nearly every one
# of them, with its leading space, as a single token, hence the 1.0 words-per-token default.
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their would been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three small large house place group number part system "
    "water hand school point government city company problem fact night story week home family "
    "money side area service question power country report order level music table result model "
    "data light river field paper plan reason market letter energy price record value garden "
    "window voice road station answer figure simple early late open close strong"
).split()


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `N` or `fixed:N`, `uniform:LO-HI`, `normal:MEAN,STD`,
    `lognormal:MEDIAN,SIGMA`. Samples are rounded and clipped to at least 1."""

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal", "lognormal"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if self.kind == "fixed" and self.a < 1:
            raise ValueError("a fixed length must be at least 1")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise ValueError(f"uniform range needs 1 <= LO <= HI, got {self.a}-{self.b}")
        if self.kind in ("normal", "lognormal") and (self.a < 1 or self.b < 0):
            raise ValueError(f"{self.kind} needs a centre >= 1 and a spread >= 0")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, _, rest = spec.partition(":") if ":" in spec else ("fixed", "", spec)
        try:
            if kind == "uniform":
                lo, hi = rest.split("-")
                return cls(kind, float(lo), float(hi))
            if kind in ("normal", "lognormal"):
                c, s = rest.split(",")
                return cls(kind, float(c), float(s))
            return cls(kind, float(rest))
        except ValueError as e:
            raise ValueError(f"bad length spec {spec!r} ({e}); "
                             "use N, uniform:LO-HI, normal:MEAN,STD or lognormal:MEDIAN,SIGMA") from None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        else:
            x = self.a * rng.lognormvariate(0.0, self.b)
        return max(1, round(x))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        sep = "-" if self.kind == "uniform" else ","
        return f"{self.kind}:{self.a:g}{sep}{self.b:g}"


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "random"
    num_requests: int = 100  # random, fixed, prefix
    isl: LengthDist = field(default_factory=lambda: LengthDist("uniform", 128, 1024))
    osl: LengthDist = field(default_factory=lambda: LengthDist("uniform", 32, 256))
    num_prefix_groups: int = 4
    prefix_len: int = 1024
    num_sessions: int = 8  # agentic
    turns: LengthDist = field(default_factory=lambda: LengthDist("fixed", 4))
    tool_len: LengthDist = field(default_factory=lambda: LengthDist("uniform", 128, 512))
    words_per_token: float = 1.0
    dataset_path: str | None = None  # dataset: JSONL prompts or a ShareGPT JSON file
    # trace (tools/bench/serve/trace.py): the files, the tokens a hash id covers (None: the
    # trace's own), and the factor lengths are divided by (0: the smallest that fits the
    # server's context). Its speed is the point's value (runner.py's trace mode).
    trace_paths: tuple[str, ...] = ()
    trace_block_size: int | None = None
    trace_scale: int = 0
    num_requests_set: bool = True  # trace: False replays the whole trace
    # The share of sessions sent at high_priority (vLLM's `priority`: lower is served
    # earlier); the rest go in the default class. 0: no priorities at all.
    priority_mix: float = 0.0
    high_priority: int = -1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == "dataset") != (self.dataset_path is not None):
            raise ValueError("--dataset-path goes with --workload dataset, and that workload needs it")
        if (self.kind == "trace") != bool(self.trace_paths):
            raise ValueError("--trace goes with --workload trace, and that workload needs it")
        if self.trace_scale < 0 or (self.trace_scale & (self.trace_scale - 1)):
            raise ValueError("--trace-scale must be a power of two (or auto)")
        if self.trace_block_size is not None and self.trace_block_size < 1:
            raise ValueError("--trace-block-size must be at least 1")
        if self.kind == "fixed" and (self.isl.kind != "fixed" or self.osl.kind != "fixed"):
            raise ValueError("the fixed workload takes plain integer --isl and --osl")
        if self.num_requests < 1 or self.num_sessions < 1 or self.num_prefix_groups < 1:
            raise ValueError("request, session and prefix-group counts must be at least 1")
        if self.prefix_len < 1 or self.words_per_token <= 0:
            raise ValueError("prefix length and words-per-token must be positive")
        if not 0 <= self.priority_mix <= 1:
            raise ValueError(f"--priority-mix is the share of requests sent as high priority, in [0, 1], got "
                             f"{self.priority_mix:g}")
        if self.priority_mix and self.high_priority == 0:
            raise ValueError("--high-priority must not be 0, the default class")

    @property
    def description(self) -> dict:
        return {"kind": self.kind, "num_requests": self.num_requests, "isl": str(self.isl),
                "osl": str(self.osl), "num_prefix_groups": self.num_prefix_groups,
                "prefix_len": self.prefix_len, "num_sessions": self.num_sessions,
                "turns": str(self.turns), "tool_len": str(self.tool_len),
                "words_per_token": self.words_per_token, "dataset_path": self.dataset_path,
                **({"trace_paths": list(self.trace_paths), "trace_block_size": self.trace_block_size,
                    "trace_scale": self.trace_scale or "auto"}
                   if self.kind == "trace" else {}),
                **({"priority_mix": self.priority_mix, "high_priority": self.high_priority}
                   if self.priority_mix else {})}


@dataclass(frozen=True)
class Turn:
    text: str  # the whole prompt for turn 1, the appended tool output after
    input_len: int  # target tokens of `text`
    max_tokens: int
    prompt_ids: tuple[int, ...] | None = None  # trace: the prompt as token ids (text is then "")
    trace_input_len: int | None = None  # trace: the prompt's length before scaling


@dataclass(frozen=True)
class SessionSpec:
    session: int
    turns: tuple[Turn, ...]
    group: int | None = None  # prefix-sharing group
    priority: int | None = None  # with a priority mix: its class (0: the default's); None: no mix


@dataclass(frozen=True)
class Workload:
    sessions: tuple[SessionSpec, ...]
    arrivals: tuple[float, ...]  # unit-rate Poisson start offsets, one per session (trace: its times)
    trace: dict | None = None  # trace: its scale and the hit rate it implies (see trace_stream)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from a model directory (its tokenizer.json) or the file."""
    from tokenizers import Tokenizer

    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(p))


class TextSource:
    """Random word text of a target token length."""

    def __init__(self, rng: random.Random, tokenizer=None, words_per_token: float = 1.0):
        self.rng, self.tokenizer, self.words_per_token = rng, tokenizer, words_per_token

    def _words(self, n: int) -> list[str]:
        return [self.rng.choice(WORDS) for _ in range(n)]

    def text(self, num_tokens: int) -> str:
        if self.tokenizer is None:
            return " ".join(self._words(max(1, round(num_tokens * self.words_per_token))))
        words = self._words(num_tokens + 8)
        while True:
            text = " ".join(words)
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            if len(enc.ids) >= num_tokens:
                # Cutting at a token's end offset gives exactly num_tokens tokens, give or
                # take a merge across the cut.
                return text[:enc.offsets[num_tokens - 1][1]]
            words += self._words(num_tokens - len(enc.ids) + 8)


def build(cfg: WorkloadConfig, seed: int, salt: int | str = 0, tokenizer=None,
          max_model_len: int | None = None) -> Workload:
    """The request stream for one benchmark point.

    Args:
        seed: drives lengths, turn counts, prefix groups and arrival offsets.
        salt: varies only the words, so sweep points get identical shapes but fresh text
            that a server's prefix cache has not seen at an earlier point.
        max_model_len: the server's context; a trace is scaled to fit it.
    Returns:
        A Workload; the same (cfg, seed, salt) always gives an equal one.
    """
    work = trace_stream(cfg, seed, salt, tokenizer, max_model_len) if cfg.kind == "trace" else \
        _stream(cfg, seed, salt, tokenizer)
    return with_priorities(work, cfg, seed) if cfg.priority_mix else work


def with_priorities(work: Workload, cfg: WorkloadConfig, seed: int) -> Workload:
    """round(priority_mix x sessions) of the sessions, drawn at random, in the high class;
    the rest in the default one."""
    n = len(work.sessions)
    high = set(random.Random(f"moemesh-serve:{seed}:priority").sample(range(n), round(cfg.priority_mix * n)))
    sessions = tuple(replace(s, priority=cfg.high_priority if i in high else 0) for i, s in enumerate(work.sessions))
    return replace(work, sessions=sessions)


def _stream(cfg: WorkloadConfig, seed: int, salt: int | str, tokenizer) -> Workload:
    shape = random.Random(f"moemesh-serve:{seed}:shape")
    text = TextSource(random.Random(f"moemesh-serve:{seed}:text:{salt}"), tokenizer, cfg.words_per_token)
    sessions = []
    if cfg.kind == "dataset":
        entries = load_dataset(cfg.dataset_path)
        shape.shuffle(entries)
        for i, (prompt, reply, n_out) in enumerate(entries[: cfg.num_requests]):
            if n_out is None:  # ShareGPT: as long as the recorded reply (vLLM's rule), else --osl
                n_out = _length(reply, tokenizer, cfg.words_per_token) if reply else cfg.osl.sample(shape)
            sessions.append(SessionSpec(i, (Turn(prompt, _length(prompt, tokenizer, cfg.words_per_token), n_out),)))
    elif cfg.kind == "agentic":
        for s in range(cfg.num_sessions):
            n_turns = cfg.turns.sample(shape)
            turns = []
            for k in range(n_turns):
                n_in = (cfg.isl if k == 0 else cfg.tool_len).sample(shape)
                body = text.text(n_in)
                # Separators keep a completion prompt readable; the chat form strips nothing.
                turns.append(Turn(body if k == 0 else f"\n\n{body}\n\n", n_in, cfg.osl.sample(shape)))
            sessions.append(SessionSpec(s, tuple(turns)))
    else:
        prefixes = []
        if cfg.kind == "prefix":
            prefixes = [text.text(cfg.prefix_len) for _ in range(cfg.num_prefix_groups)]
        for i in range(cfg.num_requests):
            n_in, n_out = cfg.isl.sample(shape), cfg.osl.sample(shape)
            if cfg.kind == "prefix":
                g = i % cfg.num_prefix_groups
                turn = Turn(f"{prefixes[g]} {text.text(n_in)}", cfg.prefix_len + n_in, n_out)
                sessions.append(SessionSpec(i, (turn,), g))
            else:
                sessions.append(SessionSpec(i, (Turn(text.text(n_in), n_in, n_out),)))
    arrivals, t = [], 0.0
    for i in range(len(sessions)):
        arrivals.append(t)
        t += shape.expovariate(1.0)
    return Workload(tuple(sessions), tuple(arrivals))


def trace_stream(cfg: WorkloadConfig, seed: int, salt: int | str, tokenizer, max_model_len: int | None) -> Workload:
    """A trace's requests, one session each, at the trace's times (seconds from its start)."""
    from moemesh.tools.bench.serve import trace as tr

    if tokenizer is None:
        raise ValueError("--workload trace needs --tokenizer MODEL_DIR: its vocabulary gives the prompts' token ids")
    t = tr.load(list(cfg.trace_paths), cfg.trace_block_size, cfg.num_requests if cfg.num_requests_set else None)
    factor = cfg.trace_scale or tr.scale_for(t, max_model_len)
    sent = tr.replay(t, factor, tr.token_pool(tokenizer), seed=f"{seed}:{salt}")
    sessions = tuple(SessionSpec(i, (Turn("", len(r.prompt_ids), r.max_tokens, r.prompt_ids, r.trace_input_len),))
                     for i, r in enumerate(sent))
    prompt = sum(len(r.prompt_ids) for r in sent)
    hit = sum(r.implied_hit for r in sent)
    info = {"formats": list(t.formats), "block_size": t.block_size, "scale": factor,
            "block_tokens": t.block_size // factor, "requests": len(sent),
            "span_s": (t.requests[-1].t_s if t.requests else 0.0),
            "longest_context": t.longest, "prompt_tokens": prompt, "implied_cached_tokens": hit,
            "implied_hit_rate": hit / prompt if prompt else None}
    return Workload(sessions, tuple(r.t_s for r in sent), info)


def over_context(work: Workload, max_model_len: int | None) -> int:
    """Requests of `work` whose prompt plus max_tokens will not fit a server's context of
    max_model_len tokens (None: unknown, 0), by target lengths. A session's turn k
    resends every earlier turn and answer, so agentic sessions grow past it first."""
    if not max_model_len:
        return 0
    n = 0
    for s in work.sessions:
        ctx = 0
        for t in s.turns:
            ctx += t.input_len
            n += ctx + t.max_tokens > max_model_len
            ctx += t.max_tokens
    return n


def _length(text: str, tokenizer, words_per_token: float) -> int:
    if tokenizer is not None:
        return max(1, len(tokenizer.encode(text, add_special_tokens=False).ids))
    return max(1, round(len(text.split()) / words_per_token))


def load_dataset(path: str | Path) -> list[tuple[str, str | None, int | None]]:
    """(prompt, recorded reply, output length) per entry of a local dataset file:
    - JSONL, one object per line: {"prompt": str} with an optional "output_len" (or
      "max_tokens"), as vLLM's custom dataset;
    - ShareGPT JSON: a list of {"conversations": [{"from": "human", "value": ...},
      {"from": "gpt", "value": ...}, ...]}; the first human turn is the prompt, the reply
      after it sets the output length. Entries without a human turn are skipped."""
    import json

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read dataset {path}: {e.strerror or e}") from None
    out: list[tuple[str, str | None, int | None]] = []
    if p.suffix == ".jsonl" or not text.lstrip().startswith("["):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                raise ValueError(f"{path}:{n}: each line needs a non-empty string \"prompt\"")
            n_out = obj.get("output_len", obj.get("max_tokens"))
            if n_out is not None and not (type(n_out) is int and n_out >= 1):
                raise ValueError(f"{path}:{n}: output_len must be a positive integer")
            out.append((obj["prompt"], None, n_out))
    else:
        try:
            rows = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        for row in rows if isinstance(rows, list) else ():
            conv = row.get("conversations") if isinstance(row, dict) else None
            turns = [t for t in conv or () if isinstance(t, dict) and isinstance(t.get("value"), str)]
            for i, t in enumerate(turns):
                if t.get("from") in ("human", "user") and t["value"]:
                    nxt = turns[i + 1] if i + 1 < len(turns) else None
                    reply = nxt["value"] if nxt is not None and nxt.get("from") in ("gpt", "assistant") else None
                    out.append((t["value"], reply or None, None))
                    break
    if not out:
        raise ValueError(f"{path}: no prompts found (JSONL with \"prompt\", or ShareGPT conversations)")
    return out


def context_after(messages: list[dict], answer: str, next_turn: Turn) -> list[dict]:
    """The chat context of the next turn: everything so far, the model's answer, the tool output."""
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": next_turn.text}]


def render_completion(messages: list[dict]) -> str:
    """A completion prompt is the context's text run together, so that each turn's prompt
    starts with the previous prompt followed by the previous answer."""
    return "".join(m["content"] for m in messages)
