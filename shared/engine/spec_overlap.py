"""MTP steps planned while the step before runs: plan N+1 for the worst case, correct on
the device thread.

Whole MTP steps (speculative.py) cannot overlap: how many of step N's drafts the target
accepts decides where step N+1's rows sit. Here N+1 is planned during N as if every
draft of N were accepted (the most tokens, hence the most blocks and the furthest
positions), and whatever N really accepted is settled where it is known:

- on the device thread, before N+1's forward: each of N+1's rows that continues a
  sequence of N moves back by N's rejected drafts (positions, cache slots, context
  lengths), and takes its inputs from N's outputs: the token the target gave at the end
  of what it accepted, then the drafts the MTP layer made there. Shapes never change: a
  sequence has 1 + its drafts rows whatever was accepted.
- on the host, when N lands (beside N+1): the placeholders N left in its sequences
  become the accepted tokens, and counts and N+1's chunk starts move back the same way.

So every row computes what the whole step would have, at the same position, from the
same tokens: outputs are the same (greedy, and seeded sampling, whose generators are
keyed by the real output position). Rows of a sequence that stops in N, or is aborted
while N runs, are wasted in N+1 and dropped when it lands; their blocks stay out of use
until N+1 is done (the block manager's step fence).

Verification and the MTP pass are queued on the device after the forward, before the
step's one wait (spec_decode.verify_tensors reads nothing back). The MTP pass runs over the step's own rows
(its batch, with each row's next token as input: the accepted drafts, then the target's
token), and the draft is read at the last accepted row. The rows past it write the MTP
layer's cache at positions the next step computes again before anything reads them.

What it covers: decode rows of one draft a step (num_speculative_tokens = 1) on MLA
models and the mock, without a grammar, forks or a prefill chunk. A step that needs any
of those runs whole (`WHOLE`), after the steps in flight have landed. A sequence whose
next step could need fewer drafts (near max_tokens or the context's end) waits for its
step to land before it is planned again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
import torch

from moemesh.shared.engine import host_copy, sampler
from moemesh.shared.engine.outputs import RequestOutput, StepOutputs, StepStats, step_outputs
from moemesh.shared.engine.planned_step import BLOCKED
from moemesh.shared.engine.runner import Chunk, build_batch
from moemesh.shared.engine.sequence import PLACEHOLDER, SeqStatus, StopRule
from moemesh.shared.engine.spec_decode import verify_tensors
from moemesh.shared.model.batch import ForwardBatch
from moemesh.shared.protocol.messages import SamplingParams

# `eng` below is the LLMEngine (engine.py), which imports this module: named, not imported.


class Whole:
    """plan()'s answer for a step that must run whole (speculative.WholeStep): nothing in
    flight, and a chunk this path does not take."""


WHOLE = Whole()


@dataclass
class MTPStep:
    """One planned MTP step; the device thread fills the second half."""

    chunks: list[Chunk]
    batch: ForwardBatch
    step_id: int
    num_drafts: list[int]  # per chunk: the drafts its rows verify
    params: list[SamplingParams]
    seeded: list[tuple[object, int]]  # per chunk: (sequence's seed source, its planned start), for generators
    block_size: int
    prev: "MTPStep | None" = None  # the step in flight when this one was planned
    from_prev: list[int] = field(default_factory=list)  # per chunk: its index in prev, -1 if none
    stats: StepStats | None = None
    queued_at: float = 0.0
    next: "MTPStep | None" = None  # host side: the step planned while this one was in flight
    # set on the device thread
    accepted: list[int] | None = None  # per chunk
    tokens: list[list[int]] | None = None  # per chunk: accepted drafts, then the target's token
    bonus: torch.Tensor | None = None  # [chunks] the target's token, on the device
    drafts: torch.Tensor | None = None  # [chunks] the MTP layer's next draft, on the device
    next_drafts: list[int] = field(default_factory=list)  # the same, read on the host
    logits: torch.Tensor | None = None  # [rows, vocab] on the host, for logprobs
    shift: list[int] | None = None  # per chunk: how far it moved back (its prev's rejected drafts)
    t_start: float = 0.0
    t_end: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


def eligible(eng: "LLMEngine") -> bool:
    """Whether the engine's MTP steps can go this way at all."""
    return (eng.use_mtp and eng.num_spec == 1 and not eng.hybrid and eng.cfg.role != "prefill"
            and eng.graphs is None and eng.snapshots is None and eng.cfg.overlap_mtp)


def _decode_chunk(c: Chunk, k: int) -> bool:
    seq = c.seq
    return (seq.in_decode and len(c.token_ids) <= 1 + k and seq.matcher is None and not seq.forks
            and seq.cow_src < 0 and seq.status is SeqStatus.RUNNING)


def plan(eng: "LLMEngine", inflight: MTPStep | None, step_id: int):
    """The next step, planned as if `inflight` had accepted every draft; WHOLE, BLOCKED
    (from the engine) or None as LLMEngine.plan_step says."""
    t0 = time.perf_counter()
    if inflight is None:
        eng.drafter.resolve()  # a whole step's drafts, still pending: their ids, now
    if eng.admission.constrained and eng.admission.live_constrained() and inflight is not None:
        return BLOCKED  # a grammar's rows run whole
    got = eng.schedule_chunks(inflight is None)
    if got is None or got is BLOCKED:
        return got
    st, chunks = got
    k = eng.num_spec
    if not all(_decode_chunk(c, k) for c in chunks):
        return BLOCKED if inflight is not None else WHOLE
    t1 = time.perf_counter()
    batch = build_batch(chunks, eng.cfg.block_size, eng.device, None, None, eng.tables, eng.row_keys)
    prev_index = {id(c.seq): i for i, c in enumerate(inflight.chunks)} if inflight is not None else {}
    step = MTPStep(chunks, batch, step_id, [c.q_len - 1 for c in chunks], [c.seq.params for c in chunks],
                   [(c.seq, c.start) for c in chunks], eng.cfg.block_size, inflight,
                   [prev_index.get(id(c.seq), -1) for c in chunks], st)
    budget = eng.drafter.budget
    for c in chunks:
        seq = c.seq
        q = len(c.token_ids)
        # The worst case: every draft accepted, then the target's token.
        seq.num_computed = c.start + q
        seq.token_ids += [PLACEHOLDER] * q
        seq.draft_ids = [PLACEHOLDER] * k
        # Planned again while this step runs only if its next step surely drafts k:
        # otherwise that depends on what this one accepts.
        seq.hold_step = step_id if budget(seq) < k or len(seq.token_ids) > seq.last_slot else -1
    if inflight is not None:
        inflight.next = step
    st.num_seqs, st.num_decode = len(chunks), batch.num_decode
    st.num_tokens = batch.num_tokens
    st.scheduled = [c.seq.request_id for c in chunks]
    t2 = time.perf_counter()
    st.schedule_s, st.prepare_s = t1 - t0, t2 - t1
    return step


def empty(eng, step_id: int) -> MTPStep:
    """A lockstep rank's step with no work of its own: its forward and draft pass run on an
    empty batch, so that its collectives meet the other ranks'."""
    batch = build_batch([], eng.cfg.block_size, eng.device, None, None, eng.tables, eng.row_keys)
    return MTPStep([], batch, step_id, [], [], [], eng.cfg.block_size, stats=StepStats())


def run(step: MTPStep, model, kv, before_wait=None) -> None:
    """The device part: settle the step before's outcome into this step's rows, forward,
    verify, draft, then wait once.

    Verification and the draft pass are queued device work (verify_tensors reads nothing
    back): the one wait reads the outcome, as a plain step's reads its sampled ids."""
    step.t_start = time.perf_counter()
    prev, step.prev = step.prev, None
    batch = step.batch
    batch.queued_at = step.queued_at
    C = len(step.chunks)
    step.shift = [0] * C
    if prev is not None and any(i >= 0 for i in step.from_prev):
        _settle(step, prev, batch)
    hidden = model(batch, kv)
    if before_wait is not None:  # the forward is queued: the step before can land beside it
        before_wait()
    T = batch.num_tokens
    logits = model.compute_logits(hidden[:T])
    dev = batch.input_ids.device
    rows = [c.row for c in step.chunks]
    K = max(step.num_drafts, default=0)
    rows_t = host_copy.to_device(rows, torch.long, dev)
    at = (rows_t[:, None] + 1 + torch.arange(K, device=dev)).clamp(max=max(T - 1, 0))
    draft_ids = batch.input_ids[at]  # [C, K]: each row's drafts (settled), past them ignored
    gens = [seq.generator_at(start - sh + 1) if not p.greedy else None
            for (seq, start), sh, p in zip(step.seeded, step.shift, step.params)]
    accepted, bonus = verify_tensors(logits, rows, step.num_drafts, draft_ids, step.params, gens)
    # The MTP pass over the step's rows: each row's input is the next position's token.
    last = rows_t + accepted
    mtp_ids = torch.cat([batch.input_ids[1:], batch.input_ids[:1]])
    mtp_ids[last] = bonus
    h = model.mtp_forward(replace(batch, input_ids=mtp_ids), hidden[:T], kv)
    step.bonus, step.drafts = bonus, model.mtp_logits(h[last]).argmax(dim=-1)
    want_lp = any(p.logprobs is not None for p in step.params)
    got = host_copy.to_host(accepted, bonus, draft_ids, step.drafts, *((logits,) if want_lp else ()))
    sync = getattr(model, "synchronize", None)
    if sync is not None:
        sync()
    t2 = time.perf_counter()
    window = getattr(model, "device_window", None)
    dev_start, dev_end = window() if window is not None else (step.t_start, t2)
    acc, tok, ds = got[0].tolist(), got[1].tolist(), got[2].tolist()
    step.tokens = [d[:a] + [t] for d, a, t in zip(ds, acc, tok)]
    step.accepted = acc
    step.next_drafts = got[3].tolist()
    step.logits = got[4] if want_lp else None
    step.t_start, step.t_end = dev_start, max(dev_end, dev_start)
    step.forward_s = step.t_end - step.t_start
    step.sample_s = time.perf_counter() - t2


def _settle(step: MTPStep, prev: MTPStep, batch: ForwardBatch) -> None:
    """Move each row that continues a sequence of `prev` back by prev's rejected drafts
    and give it prev's outputs as inputs (its first row the target's token, the rest the
    MTP layer's draft)."""
    rows, back, first, src, draft_rows, draft_src = [], [], [], [], [], []
    for i, (c, j) in enumerate(zip(step.chunks, step.from_prev)):
        if j < 0:
            continue
        d = prev.num_drafts[j] - prev.accepted[j]
        step.shift[i] = d
        first.append(c.row)
        src.append(j)
        for r in range(c.row + 1, c.row + c.q_len):
            draft_rows.append(r)
            draft_src.append(j)
        if d:
            rows += range(c.row, c.row + c.q_len)
            back += [d] * c.q_len
    dev = batch.input_ids.device
    t = lambda xs: host_copy.to_device(xs, torch.long, dev)  # noqa: E731
    batch.input_ids[t(first)] = prev.bonus[t(src)]
    if draft_rows:
        batch.input_ids[t(draft_rows)] = prev.drafts[t(draft_src)]
    if rows:
        r = t(rows)
        pos = batch.positions[r] - t(back)
        batch.positions[r] = pos
        if batch.decode_block_tables is not None:
            bs = step.block_size
            batch.slot_mapping[r] = batch.decode_block_tables[r, pos // bs] * bs + pos % bs
            batch.decode_context_lens[r] = pos + 1


def land(eng: "LLMEngine", step: MTPStep) -> StepOutputs:
    """Write what the step accepted into its sequences (host; after run has returned).
    The step planned after it (in flight now, if any) moves back with it. Its stats are
    step.stats, for the engine to add up."""
    t0 = time.perf_counter()
    st = step.stats
    nxt, step.next = step.next, None
    later = {id(c.seq): c for c in nxt.chunks} if nxt is not None else {}
    drafts = step.next_drafts
    outputs: list[RequestOutput] = []
    k = eng.num_spec
    register, stop, admission = eng.prefix.register, eng.stop_reason, eng.admission
    for i, c in enumerate(step.chunks):
        seq = c.seq
        if seq.hold_step == step.step_id:
            seq.hold_step = -1
        if seq.status is not SeqStatus.RUNNING:  # aborted while it ran, or stopped the step before
            continue
        toks = step.tokens[i]
        a, nd = len(toks) - 1, step.num_drafts[i]
        seq.num_drafted += nd
        seq.num_accepted += a
        st.num_drafted += nd
        st.num_accepted += a
        back = nd - a
        start = c.start  # real: moved back when the step before landed
        seq.token_ids[start + 1 : start + 2 + nd] = toks
        seq.num_computed -= back
        n = later.get(id(seq))
        if n is not None:
            n.start -= back
        register(seq, through=start + 1 + a)
        emitted, reason = _stops(stop, seq, start, toks)
        lp = None
        if seq.params.logprobs is not None:
            lp = sampler.logprobs_of(step.logits[c.row : c.row + len(toks)], torch.tensor(toks),
                                     [seq.params.logprobs] * len(toks))[: len(emitted)]
        out = RequestOutput(seq.request_id, emitted, logprobs=lp, num_prompt_tokens=seq.num_prompt_tokens,
                            position=start + 1 - seq.num_prompt_tokens)
        if reason is not None:
            del seq.token_ids[start + 1 + len(emitted) :]
            admission.finish(seq, reason)
            out.finished, out.finish_reason = True, reason
            if eng.blocks.enable_caching:
                out.block_hashes = seq.block_hashes[: seq.num_registered]
        elif n is None:  # not in the step in flight: its drafts are read, as a whole step leaves them
            seq.draft_ids = [drafts[i]][: min(k, eng.drafter.budget(seq))]
        outputs.append(out)
    st.land_s = time.perf_counter() - t0
    # Verification and the draft pass run on the device thread after the device's step:
    # the part the next step waits for is its exposed host time, not this step's forward.
    st.forward_s, st.sample_s, st.draft_s = step.forward_s, 0.0, step.sample_s
    st.total_s = st.schedule_s + st.prepare_s + step.forward_s + step.sample_s + st.land_s
    return step_outputs(outputs)


def _stops(stop: StopRule, seq, start: int, toks: list[int]):
    """(the tokens emitted, the finish reason or None), by the engine's stop rule, on
    token_ids that already hold them."""
    for j, t in enumerate(toks):
        reason = stop(seq.params, t, start + 2 + j - seq.num_prompt_tokens, start + 2 + j)
        if reason is not None:
            return toks[: j + 1], reason
    return toks, None
