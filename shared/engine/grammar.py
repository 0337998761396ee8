"""Structured output where tokens are chosen: a token bitmask per constrained row.

Glossary:
- matcher: one request's position in its grammar (an llguidance LLMatcher). It has
  consumed exactly the request's output tokens so far; it is advanced on the device
  thread right after each sampling, and nowhere else while the request runs.
- bitmask: [rows, ceil(V / 32)] int32, bit v of a row set when token v may come next.

N = constrained rows, V = vocabulary, W = ceil(V / 32).

Only the constrained rows of a step pay anything: a step whose plan has no constrained
row carries no GrammarRows and runs exactly as before. For those that do, the masks of
all of them are computed in one library call (its own threads, the GIL released), the
masked logits are written with one indexed assignment, and all matchers advance in one
call after sampling.

The state is rebuilt, not shipped: a worker that takes a request over (a decode worker
after the hand-off, a recompute after a failed transfer) makes a matcher from the spec in
the request's sampling parameters and feeds it the tokens generated so far.

MTP drafts are checked against the grammar: the target's row for draft j is masked with
the state after drafts 0..j-1, so a draft the grammar forbids has probability 0 and is
rejected by verification like any other; the drafts consumed to compute those masks are
rolled back to the ones accepted.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from moemesh.shared.grammar.compile import GrammarError, to_library
from moemesh.shared.protocol.messages import GrammarSpec


# From this many constrained rows in a step, masks are computed and tokens consumed on the
# library's thread pool, in one call; below it, one row after another on the device thread.
PARALLEL_ROWS = 16


@dataclass
class GrammarRows:
    """A planned step's constrained sampling rows: (row in the step's logits, matcher)."""
    runtime: "GrammarRuntime"
    rows: list[tuple[int, LLMatcher]]


class GrammarRuntime:
    def __init__(self, model_dir: str, vocab_size: int, eos_ids: set[int]):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: LLTokenizer | None = None
        self._executor: LLExecutor | None = None
        # byte value -> its 8 bits, low bit first: the bitmask read as bytes (little-endian
        # words) unpacks with one gather, bit b of byte k being token 8k + b
        self._unpack = (torch.arange(256)[:, None] >> torch.arange(8)).bitwise_and_(1).bool()  # [256, 8]
        self.num_masked_rows = 0  # rows masked since start (bench grammar reads them) ...
        self.busy_s = 0.0  # ... and the time spent masking and feeding matchers

    @property
    def tokenizer(self) -> LLTokenizer:
        """Built on the first constrained request (about a second for a 129k vocabulary),
        once per process and checkpoint."""
        if self._tokenizer is None:
            self._tokenizer = _tokenizer(self.model_dir, self.vocab_size, tuple(self.eos_ids))
        return self._tokenizer

    def matcher(self, spec: GrammarSpec, output_ids: list[int] = ()) -> LLMatcher:
        """A matcher that has consumed output_ids. Raises GrammarError."""
        # The gateway validated the spec; the matcher's construction compiles it again
        # (and reports an error through is_error rather than raising).
        try:
            m = LLMatcher(self.tokenizer, to_library(spec), log_level=0)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        if m.is_error():
            raise GrammarError(m.get_error())
        if output_ids and not m.consume_tokens(list(output_ids)):
            raise GrammarError("the tokens generated so far do not match the grammar")
        return m

    # ---- plain rows ------------------------------------------------------------------
    def mask(self, logits: torch.Tensor, rows: list[tuple[int, LLMatcher]]) -> None:
        """Forbidden tokens of the given rows of logits [R, V] to -inf, in place."""
        t0 = time.perf_counter()
        bitmask = torch.empty(len(rows), self._width, dtype=torch.int32)  # [N, W]
        nbytes = self._width * 4
        if len(rows) < PARALLEL_ROWS:
            # On this thread (each call releases the GIL): handing a few rows to the
            # library's pool costs more in thread wake-ups than it saves.
            base = bitmask.data_ptr()
            for i, (_, m) in enumerate(rows):
                m.unsafe_compute_mask_ptr(base + i * nbytes, nbytes)
        else:
            self._pool().unsafe_compute_mask_ptr([(m, i) for i, (_, m) in enumerate(rows)], bitmask.data_ptr(),
                                                 nbytes, len(rows))
        self._apply(logits, [r for r, _ in rows], bitmask)
        self.busy_s += time.perf_counter() - t0

    def advance(self, rows: list[tuple[int, LLMatcher]], sampled: torch.Tensor) -> None:
        """Feed each row's matcher the token sampled for it. A matcher whose grammar is
        done takes nothing more: its request ends with the end-of-sequence token it just
        sampled (or a step planned before that landed samples a row that is thrown away)."""
        t0 = time.perf_counter()
        toks = sampled.tolist()
        live = [(m, toks[r]) for r, m in rows if not m.is_stopped()]
        if len(live) < PARALLEL_ROWS:
            for m, t in live:
                m.consume_token(t)
        else:
            self._pool().consume_token_par(live)
        self.busy_s += time.perf_counter() - t0

    # ---- MTP drafts --------------------------------------------------------------------
    def mask_drafts(self, logits: torch.Tensor, matcher: LLMatcher, drafts: list[int]) -> int:
        """logits [k+1, V]: row j scores the token after drafts[:j]. Masks each row that
        verification may read with the state after drafts[:j], consuming the drafts the
        grammar allows on the way. Returns how many were consumed (a prefix of drafts); a
        later draft is forbidden by the mask of its row, so verification rejects it there
        and never reads the rows after it."""
        n_ok = 0 if matcher.is_stopped() else matcher.validate_tokens(drafts)
        bitmask = torch.empty(n_ok + 1, self._width, dtype=torch.int32)  # [n_ok+1, W]
        for j in range(n_ok + 1):
            matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), self._width * 4)
            if j < n_ok:
                matcher.consume_token(drafts[j])
        self._apply(logits, list(range(n_ok + 1)), bitmask)
        return n_ok

    def settle(self, matcher: LLMatcher, num_consumed: int, tokens: list[int]) -> None:
        """After verification: tokens = the accepted drafts then one token from the target.
        Roll back the consumed drafts that were rejected, then feed the last token."""
        num_accepted = len(tokens) - 1
        if num_consumed > num_accepted:
            matcher.rollback(num_consumed - num_accepted)
        if not matcher.is_stopped():
            matcher.consume_token(tokens[-1])

    # ---- helpers -----------------------------------------------------------------------
    def _pool(self) -> LLExecutor:
        if self._executor is None:
            self._executor = LLExecutor()
        return self._executor

    @property
    def _width(self) -> int:
        return (self.vocab_size + 31) // 32

    def _apply(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """logits[rows[i]] keeps the tokens bitmask[i] allows; the others go to -inf."""
        N, V = len(rows), logits.shape[1]
        if self._unpack.device != logits.device:
            self._unpack = self._unpack.to(logits.device)
        by = bitmask.view(torch.uint8).to(logits.device, non_blocking=True).flatten().long()  # [N * 4W]
        forbid = ~self._unpack.index_select(0, by).view(N, -1)[:, :V]  # [N, V]
        if logits.device.type == "cpu":
            # In place, row by row: a gather and a scatter of the rows cost more than the
            # fill itself at a large vocabulary (and one op per row is cheap on a CPU).
            for i, r in enumerate(rows):
                logits[r].masked_fill_(forbid[i], float("-inf"))
        else:
            idx = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
            logits[idx] = logits[idx].masked_fill_(forbid, float("-inf"))
        self.num_masked_rows += N


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str, vocab_size: int, eos_ids: tuple[int, ...]) -> LLTokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise GrammarError(f"structured output needs the checkpoint's tokenizer.json, and {path} is missing")
    # n_vocab: the model's (often padded) vocabulary, so the masks match its logits; ids
    # past the tokenizer's own have no text and are never allowed.
    return LLTokenizer(path.read_text(), n_vocab=vocab_size, eos_token=list(eos_ids))
