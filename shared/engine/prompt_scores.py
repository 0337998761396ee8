"""Prompt logprobs: a prompt's own tokens scored by the model, in the forward that
computes their KV (the prefill's), for the requests that ask (SamplingParams.prompt_logprobs).

Glossary (P = prompt tokens): position j's logits are the distribution of token j + 1,
so a prompt has P - 1 scored tokens, 1 .. P-1 (token 0 has nothing before it). A chunk
that computes positions s .. s+q-1 scores tokens s+1 .. min(s+q, P-1); the last prompt
position's logits are the first output token's, which the sampler reads as always.

Lifecycle of a request's scores: its columns are made at admission (PromptLogprobs.empty)
-> each step that computes a chunk of its prompt fills that chunk's rows (plan, on the
host; score, on the device thread, from the step's hidden states; file, when the step
lands) -> they leave with its first token (outputs' prompt_logprobs). A parent of n > 1
children hands its columns to them at the fork (engine/fork.py): it computes every
prompt position they score. A preempted sequence recomputes its prompt, and each chunk
fills its rows again.

A request that asks never starts on cached blocks (the prefix cache, a peer's, the KV
store's): no forward here computed those positions' logits, and recomputing them is the
only way to have them. Only rows of requests that ask go through the LM head; a decode
step or an unscored prompt costs nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.shared.engine.host_copy import to_device
from moemesh.shared.engine.runner import Chunk
from moemesh.shared.engine.sampler import LOGPROB_FLOOR
from moemesh.shared.engine.sequence import Sequence

ROWS_PER_PASS = 256  # the LM head's rows at a time: [rows, V] float32 stays a few hundred MB at V = 129k


@dataclass(slots=True)
class ScoreRows:
    """One chunk's scored rows: hidden rows row .. row+n-1 score prompt tokens first .. first+n-1."""
    seq: Sequence
    row: int
    first: int
    n: int


@dataclass(slots=True)
class Scores:
    """A step's scores, all chunks' rows together, on the device until filed."""
    logprobs: torch.Tensor  # [R] float32
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor | None  # [R, K] (K: the most any of them asked for), None when K = 0
    top_logprobs: torch.Tensor | None


def wants(seq: Sequence) -> bool:
    """Whether the sequence's prompt positions are scored: it asked, and it has not sampled
    yet (a decode worker recomputing a prompt whose KV transfer failed sent them before)."""
    return seq.prompt_logprobs is not None and seq.num_tokens == seq.num_prompt_tokens


def rows_of(c: Chunk) -> ScoreRows | None:
    """The rows of a packed chunk (c.row set) that score prompt tokens, if any. Call before
    the step appends its placeholder to the chunk's sequence."""
    seq = c.seq
    if not wants(seq):
        return None
    n = min(c.start + c.q_len, seq.num_prompt_tokens - 1) - c.start
    return ScoreRows(seq, c.row, c.start + 1, n) if n > 0 else None


def score(model, hidden: torch.Tensor, rows: list[ScoreRows]) -> Scores:
    """Each planned row's logits, log-softmaxed: the logprob of the prompt token it scores,
    that token's rank, and the most likely tokens. Queued on the device, not waited for."""
    device = hidden.device
    index = torch.cat([torch.arange(r.row, r.row + r.n) for r in rows]).to(device)
    targets = to_device([t for r in rows for t in r.seq.token_ids[r.first : r.first + r.n]], torch.long, device)
    k = max(r.seq.prompt_logprobs.num_top for r in rows)
    parts = []
    for i in range(0, len(index), ROWS_PER_PASS):
        lp = torch.log_softmax(model.compute_logits(hidden[index[i : i + ROWS_PER_PASS]]).float(), dim=-1)
        lp.clamp_(min=LOGPROB_FLOOR)  # a masked -inf is reported at the floor, as the sampler's logprobs are
        tok = lp.gather(1, targets[i : i + ROWS_PER_PASS, None])  # [r, 1]
        rank = (lp > tok).sum(dim=-1) + 1
        top = lp.topk(k, dim=-1) if k else None
        parts.append((tok[:, 0], rank, top))
    cat = torch.cat
    return Scores(cat([p[0] for p in parts]), cat([p[1] for p in parts]),
                  cat([p[2].indices for p in parts]) if k else None, cat([p[2].values for p in parts]) if k else None)


def file(rows: list[ScoreRows], scores: Scores) -> None:
    """Write a landed step's scores into each sequence's columns, at its chunk's rows."""
    lps, ranks = scores.logprobs.tolist(), scores.ranks.tolist()
    top_ids = scores.top_ids.tolist() if scores.top_ids is not None else None
    top_lps = scores.top_logprobs.tolist() if scores.top_logprobs is not None else None
    at = 0
    for r in rows:
        cols = r.seq.prompt_logprobs
        i, k = r.first - 1, cols.num_top
        cols.logprobs[i : i + r.n] = lps[at : at + r.n]
        cols.ranks[i : i + r.n] = ranks[at : at + r.n]
        if k:
            cols.top_ids[i * k : (i + r.n) * k] = [t for row in top_ids[at : at + r.n] for t in row[:k]]
            cols.top_logprobs[i * k : (i + r.n) * k] = [v for row in top_lps[at : at + r.n] for v in row[:k]]
        at += r.n
