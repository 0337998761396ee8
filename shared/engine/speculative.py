"""The whole step, for engines whose next step depends on this one's outcome: with MTP
drafts (what the target verifies next is what the draft proposes now) and on lockstep
expert-parallel ranks (every rank runs every step, a fixed number of MTP passes
included). schedule -> forward -> sample or verify drafts -> update -> draft, in one call
on the device thread; the host work sits between steps.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from moemesh.shared.engine import host_copy, prompt_scores, sampler
from moemesh.shared.engine.admission import Admission
from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.drafter import Drafter
from moemesh.shared.engine.fork import copy_blocks, ring_copies, take_copy
from moemesh.shared.engine.grammar import GrammarRuntime
from moemesh.shared.engine.outputs import RequestOutput, StepStats
from moemesh.shared.engine.prefix_cache import PrefixCache
from moemesh.shared.engine.runner import Chunk
from moemesh.shared.engine.scheduler import Scheduler
from moemesh.shared.engine.sequence import FinishReason, Sequence, StopRule
from moemesh.shared.engine.spec_decode import accept_greedy, verify, verify_many
from moemesh.shared.model.batch import ForwardBatch


class WholeStep:
    def __init__(self, model, kv, build: Callable[[list[Chunk]], ForwardBatch], scheduler: Scheduler,
                 blocks: BlockManager, admission: Admission, prefix: PrefixCache, drafter: Drafter,
                 grammar: GrammarRuntime, stop: StopRule, *, num_spec: int, lockstep: bool, role: str):
        """kv: the engine's KVCache or HybridKVCache; build(chunks): the engine's batch of
        them; num_spec: MTP drafts a step verifies (0: no MTP)."""
        self.model, self.kv, self.build, self.scheduler, self.blocks = model, kv, build, scheduler, blocks
        self.admission, self.prefix, self.drafter, self.grammar, self.stop = admission, prefix, drafter, grammar, stop
        self.num_spec, self.lockstep, self.prefill = num_spec, lockstep, role == "prefill"

    @torch.inference_mode()
    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """One whole step: its outputs, and its stats, whose counts the engine adds up."""
        st = StepStats()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        st.preempted = [s.request_id for s in sched.preempted]
        t1 = time.perf_counter()
        st.schedule_s = t1 - t0
        if sched.empty and not self.lockstep:
            return [], st
        chunks = [s.chunk() for s in sched.scheduled]
        batch = self.build(chunks)
        self.drafter.fill(chunks, batch)  # the drafts it verifies, still on the device
        st.num_seqs, st.num_tokens, st.num_decode = len(chunks), batch.num_tokens, batch.num_decode
        st.scheduled = [c.seq.request_id for c in chunks]
        if self.admission.parent_of:  # a parent's chunk: to a worker, its children were scheduled
            st.scheduled += [rid for c in chunks for rid, _ in c.seq.forks]
        t2 = time.perf_counter()
        st.prepare_s = t2 - t1
        kv, prefix = self.kv, self.prefix
        snaps = prefix.snapshots is not None
        if snaps:
            restores, rings = prefix.restores(chunks), [c.seq.ring for c in chunks]  # a finished one gives its ring back
            if restores:
                kv.copy_rings([r[:2] for r in restores])
                prefix.unpin(restores)
        # Children's first steps: their copies of the parent's tail block (engine/fork.py).
        cow = [c.seq.cow_src for c in chunks if c.seq.cow_src >= 0]
        if cow:
            copy_blocks(kv.forward_arg, [take_copy(c.seq, self.blocks.block_size) for c in chunks
                                         if c.seq.cow_src >= 0])
        scoring = [r for c in chunks if c.seq.prompt_logprobs is not None and (r := prompt_scores.rows_of(c))]
        hidden = self.model(batch, kv.forward_arg)
        if scoring:  # before the update: a first token takes its prompt's scores with it
            prompt_scores.file(scoring, prompt_scores.score(self.model, hidden, scoring))
        t3 = time.perf_counter()
        st.forward_s = t3 - t2
        outputs, mtp_work = self._update(chunks, hidden, st)
        t4 = time.perf_counter()
        # The LM head is model compute: it counts as forward, not as sampling.
        st.forward_s += st.logits_s
        st.sample_s = t4 - t3 - st.logits_s
        if self.num_spec and (mtp_work or self.lockstep):
            self.drafter.propose(mtp_work, hidden)
            st.draft_s = time.perf_counter() - t4
        if cow:
            self.blocks.free(cow)
        for c in chunks:  # after the drafts: the MTP layer's KV of the parent's positions is in its blocks
            seq = c.seq
            if seq.forks and seq.num_computed == seq.num_tokens - 1:
                if pairs := ring_copies(self.admission.fork(seq)):  # V4: the children's rings, the MTP layer's rows in them
                    kv.copy_rings(pairs)
        if snaps:  # after the drafts: the MTP layer's rows are part of a snapshot
            ends = [(c.seq.num_computed, max(c.start + c.q_len, c.seq.num_computed + self.num_spec)) for c in chunks]
            taken = prefix.snapshot_plan(chunks, ends, rings)
            if taken:
                kv.copy_rings([s[:2] for s in taken])
                prefix.file_snapshots(taken)
        st.total_s = time.perf_counter() - t0
        return outputs, st

    def _update(self, chunks: list[Chunk], hidden: torch.Tensor, st: StepStats):
        sample_rows: list[int] = []
        samplers: list[tuple[Chunk, int, int]] = []  # chunk, first logits row, num rows
        for c in chunks:
            seq = c.seq
            q, n_tok = len(c.token_ids), len(seq.token_ids)
            n_draft = q - (min(n_tok, c.start + q) - c.start)
            if c.start + q - n_draft == n_tok:  # caught up: this chunk samples
                samplers.append((c, len(sample_rows), n_draft + 1))
                sample_rows.extend(range(c.row + q - n_draft - 1, c.row + q))
        logits = None
        if sample_rows:
            # Decode-only batches sample every row in order: a slice, not a gather.
            rows = hidden[: len(sample_rows)] if sample_rows[-1] == len(sample_rows) - 1 else hidden[sample_rows]
            t = time.perf_counter()
            logits = self.model.compute_logits(rows)
            pending = self.drafter.pending
            # The step's one wait: the logits and the drafts it verifies, read together.
            if pending is None:
                logits, = host_copy.to_host(logits)
            else:
                logits, drafted = host_copy.to_host(logits, pending)
                self.drafter.resolve(drafted)
            _wait_device(self.model)
            st.logits_s = time.perf_counter() - t
        else:
            self.drafter.resolve()
            _wait_device(self.model)

        # Plain (non-speculative) rows are sampled together; draft verification is per sequence.
        plain = [(c, r) for c, r, n in samplers if n == 1]
        new_tokens: dict[int, list[int]] = {}
        if plain:
            idx = [r for _, r in plain]
            seqs = [c.seq for c, _ in plain]
            sel = logits if len(idx) == logits.shape[0] else logits[idx]
            gram = [(k, s.matcher) for k, s in enumerate(seqs) if s.matcher is not None] \
                if self.admission.constrained and self.admission.live_constrained() else None
            if gram:
                self.grammar.mask(sel, gram)
            sampled = sampler.sample(sel, [s.params for s in seqs], [_gen(s) for s in seqs])
            if gram:
                self.grammar.advance(gram, sampled)
            toks = sampled.tolist()
            for (c, r), t in zip(plain, toks):
                new_tokens[id(c)] = [t]
        # Greedy, unconstrained verification needs only each row's argmax: one op for all of them.
        greedy = [c.seq.params.greedy and c.seq.matcher is None for c, _, n in samplers if n > 1]
        best = logits.argmax(dim=-1).tolist() if any(greedy) else None
        sampled: list[tuple[Chunk, int, list[int]]] = []  # sampled, unconstrained: verified together below
        for c, r, n in samplers:
            if n > 1:
                drafts = c.seq.draft_ids[: n - 1]  # read by now (the chunk holds placeholders)
                m = c.seq.matcher
                if best is not None and c.seq.params.greedy and m is None:
                    toks = accept_greedy(best[r : r + n], drafts)
                elif m is None:
                    sampled.append((c, r, drafts))
                    continue
                else:
                    # Constrained: each row is masked with the grammar's state after the drafts
                    # before it, so a forbidden draft is rejected; the rejected ones are rolled back after.
                    n_consumed = self.grammar.mask_drafts(logits[r : r + n], m, drafts)
                    toks = verify(logits[r : r + n], drafts, c.seq.params, _gen(c.seq))
                    self.grammar.settle(m, n_consumed, toks)
                new_tokens[id(c)] = toks
        if sampled:
            got = verify_many(logits, [r for _, r, _ in sampled], [d for _, _, d in sampled],
                              [c.seq.params for c, _, _ in sampled], [_gen(c.seq) for c, _, _ in sampled])
            for (c, _, _), toks in zip(sampled, got):
                new_tokens[id(c)] = toks
        for c, r, n in samplers:
            if n > 1:
                toks = new_tokens[id(c)]
                c.seq.num_drafted += n - 1
                c.seq.num_accepted += len(toks) - 1
                st.num_drafted += n - 1
                st.num_accepted += len(toks) - 1

        outputs: list[RequestOutput] = []
        mtp_work: list[tuple[Chunk, int]] = []  # chunk, number of valid positions computed
        row_of = {id(c): (r, n) for c, r, n in samplers}
        register = self.prefix.register
        for c in chunks:
            seq = c.seq
            seq.draft_ids = []
            toks = new_tokens.get(id(c))
            if toks is None:  # a prefill chunk that does not reach the end of the prompt
                seq.num_computed += c.q_len
                register(seq)
                mtp_work.append((c, c.q_len))
                continue
            seq.num_computed = c.start + (c.q_len - (row_of[id(c)][1] - 1)) + (len(toks) - 1)
            register(seq, pending=toks[:-1])  # accepted drafts are computed but not yet appended
            first = seq.num_output_tokens == 0  # its prompt is done
            if first and not seq.fork_index:  # a parent's children count it once
                st.num_prompt_tokens += seq.num_prompt_tokens
                st.num_cached_tokens += seq.num_cached_tokens
            lp = _logprobs(seq, logits, row_of[id(c)][0], toks)
            emitted, reason = _append(self.stop, seq, toks)
            out = RequestOutput(seq.request_id, emitted, logprobs=lp[: len(emitted)] if lp else None,
                                num_prompt_tokens=seq.num_prompt_tokens, position=seq.num_output_tokens - len(emitted),
                                num_cached_tokens=seq.num_cached_tokens if first else 0,
                                prompt_logprobs=seq.prompt_logprobs if first else None)
            if reason is not None:
                out.finished, out.finish_reason = True, reason
                if self.blocks.enable_caching:
                    out.block_hashes = seq.block_hashes[: seq.num_registered]
                self.admission.finish(seq, reason)
            else:
                mtp_work.append((c, seq.num_computed - c.start))
                if self.prefill:
                    self.admission.hold(seq)
                    out.prefill_done = True
            outputs.append(out)
        return outputs, mtp_work


def _logprobs(seq: Sequence, logits, row: int, toks: list[int]):
    n = seq.params.logprobs
    if n is None:
        return None
    rows = logits[row : row + len(toks)]
    return sampler.logprobs_of(rows, torch.tensor(toks), [n] * len(toks))


def _append(stop: StopRule, seq: Sequence, toks: list[int]) -> tuple[list[int], FinishReason | None]:
    """The tokens appended up to the first that stops the request, and why it stops."""
    p = seq.params
    emitted = []
    for t in toks:
        seq.token_ids.append(t)
        emitted.append(t)
        reason = stop(p, t, seq.num_output_tokens, seq.num_tokens)
        if reason is not None:
            return emitted, reason
    return emitted, None


def _gen(seq: Sequence) -> torch.Generator | None:
    # Keyed by output position, so a seeded request draws the same numbers whether it
    # is sampled here or on another worker, and however it was batched.
    return seq.generator_at(seq.num_tokens)


def _wait_device(model) -> None:
    """A device with a clock of its own (the mock) is done with the step's forward here,
    where a GPU's host would wait on it: the step's one wait."""
    sync = getattr(model, "synchronize", None)
    if sync is not None:
        sync()
