"""One engine step as three parts, so that the host can work while the device computes.

    planned (host)   schedule, build the batch, mark what each sequence will sample
      -> run (device thread)   forward, logits, sampling; inputs that the step before
                               sampled are taken from its output here, on the device
      -> landed (host)   sampled ids written into the sequences, stops checked, outputs

The serving loop plans step N+1 while step N runs and lands N while N+1 runs, so the
device never waits for Python bookkeeping that could have been done earlier (the
scheme of SGLang's overlap scheduler and vLLM's async scheduling). While N is in
flight, each sequence it samples for ends in a placeholder id and its num_computed
already counts N's positions: N+1 is planned exactly as if N had landed. The price is
a wasted row when N samples a stop token for a sequence that N+1 already computes.

Glossary: a sampling row is a sequence that gets its next token in this step (a decode
token, or the last chunk of a prompt); other chunks only fill the cache.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from moemesh.shared.engine import host_copy, prompt_scores, sampler
from moemesh.shared.engine.fork import copy_blocks
from moemesh.shared.engine.runner import Chunk
from moemesh.shared.engine.sequence import Sequence
from moemesh.shared.model.batch import ForwardBatch
from moemesh.shared.protocol.messages import SamplingParams, TokenLogprob

_step_ids = itertools.count()


class Blocked:
    """plan_step's answer when the next step would need a preemption while a step is in
    flight: land that step first, then plan again."""


BLOCKED = Blocked()


def next_step_id() -> int:
    """Step ids increase across every kind of planned step (the block manager's fence compares them)."""
    return next(_step_ids)


@dataclass
class PlannedStep:
    chunks: list[Chunk]
    batch: ForwardBatch
    seqs: list[Sequence]  # one per sampling row, in row order
    slots: list[int]  # where each row's token goes in its sequence's token_ids
    params: list[SamplingParams]
    generators: list[torch.Generator | None] | None  # None: no seeded row
    sample_rows: torch.Tensor | None  # hidden rows that sample; None: the first len(seqs) rows
    fill_rows: torch.Tensor | None = None  # input rows whose token the previous step samples ...
    fill_from: torch.Tensor | None = None  # ... at these rows of its output
    prev: "PlannedStep | None" = None
    logprobs: list[int | None] | None = None  # per row: alternatives wanted, None: off
    special: list[int] = field(default_factory=list)  # rows that may end or carry more than an id
    register: list = field(default_factory=list)  # (sequence, positions computed): blocks to cache
    # DeepSeek-V4 prefix reuse: ring copies (source, destination, ...) before and after the forward.
    restores: list = field(default_factory=list)  # snapshots into the rings of sequences starting on them
    snapshots: list = field(default_factory=list)  # (ring, snapshot ring, sequence, boundary)
    # Parallel sampling (fork.py): children's copies of their parent's tail block, made
    # before the forward; the sources' references are dropped when the step has landed.
    copies: list = field(default_factory=list)  # (source, destination) blocks
    release: list = field(default_factory=list)  # source blocks
    # V4: the rings of a parent's children 1.., copied from its own after the forward of its last chunk.
    ring_copies: list = field(default_factory=list)  # (source, destination) rings
    grammar: object = None  # GrammarRows: the constrained rows and their matchers; None: no constrained row
    scoring: list = field(default_factory=list)  # prompt_scores.ScoreRows: prompt tokens this step scores
    stats: object = None  # the engine's StepStats for this step
    step_id: int = field(default_factory=next_step_id)
    # Set by run():
    sampled: torch.Tensor | None = None  # [rows] token ids, on the CPU
    token_logprobs: list[TokenLogprob | None] | None = None
    scores: "prompt_scores.Scores | None" = None
    forward_s: float = 0.0
    logits_s: float = 0.0
    sample_s: float = 0.0
    queued_at: float = 0.0  # set by whoever queues it on a device thread
    t_start: float = 0.0
    t_end: float = 0.0
    error: BaseException | None = None

    @property
    def num_rows(self) -> int:
        return len(self.seqs)


def run(step: PlannedStep, model, kv_caches: torch.Tensor, before_wait=None, forward=None) -> None:
    """The device part of a step. Runs on the engine's device thread, one step at a time.
    Touches only the step's own tensors and the cache slots its chunks own.

    before_wait() is called once the step's forward and its cache copies are queued on the
    device (with a grammar, once its sampling is), so that the step before can land while
    this one runs (a device that computes asynchronously; see DeviceThread).
    forward: what runs the model's forward (DecodeGraphs), the model itself if None."""
    step.t_start = time.perf_counter()
    prev, step.prev = step.prev, None  # no chain of steps kept alive
    batch = step.batch
    batch.queued_at = step.queued_at
    if step.fill_rows is not None:
        ids = prev.sampled.to(batch.input_ids.device)
        batch.input_ids[step.fill_rows] = ids[step.fill_from]
    if step.restores:
        kv_caches.copy_rings([r[:2] for r in step.restores])
    if step.copies:
        copy_blocks(kv_caches, step.copies)
    hidden = (forward or model)(batch, kv_caches)
    if step.ring_copies:
        kv_caches.copy_rings(step.ring_copies)
    if step.snapshots:
        kv_caches.copy_rings([s[:2] for s in step.snapshots])
    if before_wait is not None and step.grammar is None:
        # Every write to the cache is queued: the step before lands beside the sampling.
        # (A grammar's matchers are fed on this thread below, and landing reads them: that
        # step waits until then.)
        before_wait()
        before_wait = None
    if step.scoring:
        step.scores = prompt_scores.score(model, hidden, step.scoring)
    t1 = time.perf_counter()
    if step.seqs:
        rows = hidden[: step.num_rows] if step.sample_rows is None else hidden[step.sample_rows]
        logits = model.compute_logits(rows)
        t2 = time.perf_counter()
        gram = step.grammar
        if gram is not None:  # the matchers hold every token sampled before, this thread having fed them
            gram.runtime.mask(logits, gram.rows)
        sampled = sampler.sample(logits, step.params, step.generators or [None] * step.num_rows)
        if gram is not None:
            gram.runtime.advance(gram.rows, sampled)
        if step.logprobs is not None:
            step.token_logprobs = sampler.logprobs_of(logits, sampled, step.logprobs)
        t3 = time.perf_counter()
        step.logits_s, step.sample_s = t2 - t1, t3 - t2
        if before_wait is not None:
            before_wait()
            before_wait = None
        step.sampled, = host_copy.to_host(sampled)  # a CUDA device is waited for here
    if before_wait is not None:
        before_wait()
    sync = getattr(model, "synchronize", None)
    if sync is not None:
        sync()
    step.t_end = time.perf_counter()
    window = getattr(model, "device_window", None)
    if window is not None:  # a device with a clock of its own: its busy time, not this thread's
        step.t_start, step.t_end = window()
    step.forward_s = step.t_end - step.t_start - step.sample_s
