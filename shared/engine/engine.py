"""The engine: one step is schedule -> execute -> update.

Request lifecycle (see sequence.py): waiting -> running (prefill chunks, then decode
steps with MTP drafts verified by the target) -> finished.

Two ways through a step. A step is planned, run and landed in three calls
(planned_step.py; with MTP drafts spec_overlap.py, which plans N+1 for every draft of N
accepted and settles N's outcome on the device thread), so that a serving loop can plan
step N+1 and land step N while N+1 runs on the device thread; step() calls the three in
a row. What spec_overlap does not take (a prefill chunk, a grammar or forks with drafts;
V4 with drafts; overlap_mtp off), and a lockstep rank's step() on its own, runs whole:
schedule -> forward -> verify -> draft in one call (speculative.py). Roles:
- both: offline or single-process serving.
- prefill: a request stops after its first token and is HELD; export_kv() hands its
  blocks out as one contiguous buffer and release() frees them.
- decode: add_prefilled() imports such a buffer and continues decoding.

Admission (add_request, abort, the fork of n > 1 children) is in admission.py, the
prefill -> decode hand-off in handoff.py: both run per request, this file per step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

import torch

from moemesh.shared.checkpoint.loader import load_model
from moemesh.shared.grammar.compile import GrammarError
from moemesh.shared.engine.admission import Admission
from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.decode_graphs import DecodeGraphs
from moemesh.shared.engine.drafter import Drafter
from moemesh.shared.engine.errors import NoCapacity, RequestError
from moemesh.shared.engine.fork import ring_copies, take_copy
from moemesh.shared.engine.grammar import GrammarRows, GrammarRuntime
from moemesh.shared.engine.handoff import KVHandoff
from moemesh.shared.engine.hybrid_batch import HybridBatcher
from moemesh.shared.engine.hybrid_cache import HybridKVCache
from moemesh.shared.engine.kv_cache import KVCache
from moemesh.shared.engine.outputs import Finished, RequestOutput, StepOutputs, StepStats, request_outputs
from moemesh.shared.engine.planned_step import BLOCKED, Blocked, PlannedStep, next_step_id, run
from moemesh.shared.protocol.prefix_hash import chain, kv_identity
from moemesh.shared.engine.block_table import BlockTables
from moemesh.shared.engine.runner import Chunk, Padding, build_batch
from moemesh.shared.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from moemesh.shared.engine.snapshots import SnapshotCache, boundary
from moemesh.shared.engine import spec_overlap
from moemesh.shared.engine.speculative import speculative_step
from moemesh.shared.engine.sequence import PLACEHOLDER, FinishReason, Sequence, SeqStatus
from moemesh.shared.model.batch import ForwardBatch
from moemesh.shared.model.deepseek import DeepseekForCausalLM
from moemesh.shared.model.v4.model import DeepseekV4ForCausalLM

log = logging.getLogger(__name__)

__all__ = ["BLOCKED", "Blocked", "LLMEngine", "NoCapacity", "RequestError"]


class LLMEngine(Admission, KVHandoff):
    def __init__(self, cfg: EngineConfig, model: DeepseekForCausalLM | None = None, lockstep: bool = False):
        """lockstep: every step runs the model, with an empty batch if need be, and a
        fixed number of MTP passes, as expert-parallel ranks must (collectives)."""
        self.cfg = cfg
        self.lockstep = lockstep
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device)
        self.model = model if model is not None else load_model(cfg.model, cfg.torch_dtype, self.device)
        mcfg = self.model_config = self.model.cfg
        self.hybrid = mcfg.model_type == "deepseek_v4"
        if self.hybrid:
            cfg = self.cfg = self._v4_settings(cfg, mcfg)
        self.max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        k = cfg.num_speculative_tokens
        self.num_spec = (1 if mcfg.has_mtp else 0) if k is None else (k if mcfg.has_mtp else 0)
        if k and not mcfg.has_mtp:
            log.warning("num_speculative_tokens=%d ignored: the checkpoint has no MTP layer", k)
        self.use_mtp = mcfg.has_mtp and self.num_spec > 0
        num_blocks = cfg.num_kv_blocks or self._blocks_from_memory()
        self.batcher = self.draft_batcher = None
        num_rings = 0
        self.snapshots: SnapshotCache | None = None
        if self.hybrid:
            # A ring per running sequence, and as many again for requests held for a pull;
            # with prefix caching, the boundary snapshots' rings after them.
            num_rings = 2 * cfg.max_num_seqs
            num_snaps = self._num_snapshots(cfg)
            self.kv = HybridKVCache(mcfg, num_blocks, cfg.block_size, cfg.torch_dtype, self.device, num_rings,
                                    self.num_spec, num_snaps)
            self.batcher = HybridBatcher(mcfg, cfg.block_size, tuple(r.count for r in self.kv.layout.rings))
            self.draft_batcher = self.batcher.sliding()
            if num_snaps:
                self.snapshots = SnapshotCache(num_rings, num_snaps)
        else:
            self.kv = KVCache(mcfg, num_blocks, cfg.block_size, cfg.torch_dtype, self.device)
        self.blocks = BlockManager(num_blocks, cfg.block_size, enable_caching=cfg.enable_prefix_caching,
                                   num_rings=num_rings)
        # Each running sequence's block ids, as a row the step's batch gathers (block_table.py).
        # Rows widen as sequences grow; a long max_model_len does not preallocate its width.
        width = min(self.blocks.blocks_for(self.max_model_len + self.num_spec + 1), 512)
        self.tables = BlockTables(cfg.max_num_seqs, width)
        self.row_keys = bool(getattr(self.model, "wants_row_keys", False))  # the mock's draft head asks
        self.kv_identity = kv_identity(mcfg.identity(), cfg.block_size, cfg.dtype)
        sched_cfg = SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.num_spec)
        self.scheduler = Scheduler(sched_cfg, self.blocks, self.snapshots)
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self._parent_of: dict[str, str] = {}  # child request id -> its parent's, until the fork
        self.eos_ids = set(mcfg.eos_token_ids)
        self._eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        self.graphs = self._decode_graphs()
        self.overlap_mtp = False  # set below, once the engine is whole
        self.drafter = Drafter(self.model, self.kv.forward_arg, cfg.block_size, self.num_spec, self.max_model_len,
                               self.device, lockstep, self.draft_batcher, self.tables, self.row_keys)
        self.last_stats = StepStats()
        self.num_drafted_total = 0
        self.num_accepted_total = 0
        self.num_prompt_tokens_total = 0
        self.num_cached_tokens_total = 0  # prompt tokens whose KV came from the prefix cache
        # Structured output: the running requests with a grammar, by id. Empty (the common
        # case) means a step does no grammar work at all.
        self.grammar = GrammarRuntime(cfg.model, mcfg.vocab_size, self.eos_ids)
        self.constrained: dict[str, Sequence] = {}
        self.overlap_mtp = spec_overlap.eligible(self)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The decode path of fixed shapes (decode_graphs.py); None: off."""
        mode = self.cfg.decode_graphs
        capture = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        if mode == "off" or (mode == "auto" and not capture) \
                or not isinstance(self.model, (DeepseekForCausalLM, DeepseekV4ForCausalLM)):
            return None
        bs, device, batcher, tables, keys = self.cfg.block_size, self.device, self.batcher, self.tables, self.row_keys

        def build(chunks: list[Chunk], pad: Padding) -> ForwardBatch:
            return build_batch(chunks, bs, device, batcher, pad, tables, keys)

        graphs = DecodeGraphs(self.model, self.kv.forward_arg, build, self.kv.scratch_block,
                              getattr(self.kv, "scratch_ring", -1), self.cfg.max_num_seqs, self.max_model_len, capture)
        if capture:
            try:
                graphs.capture_all()
            except Exception as e:  # noqa: BLE001 - a path that cannot be captured runs eagerly
                if mode == "on":
                    raise
                log.warning("decode steps run without CUDA graphs: capture failed (%s)", e)
                return None
        return graphs

    @property
    def can_overlap(self) -> bool:
        """Whether steps go through plan/run/land, so that a loop can overlap them: with MTP
        where spec_overlap takes its steps; a lockstep rank's without MTP unless
        overlap_lockstep is off; always otherwise."""
        if self.use_mtp:
            return self.overlap_mtp
        return not self.lockstep or self.cfg.overlap_lockstep

    @property
    def acceptance_rate(self) -> float | None:
        """Share of MTP draft tokens the target accepted, since start."""
        return self.num_accepted_total / self.num_drafted_total if self.num_drafted_total else None

    @staticmethod
    def _v4_settings(cfg: EngineConfig, mcfg) -> EngineConfig:
        """A V4 block holds whole compression groups, so a block boundary is a boundary of
        every group: what a cached block holds is complete, and a boundary snapshot
        (engine/snapshots.py) is the rest of the state there."""
        bs = math.lcm(cfg.block_size, mcfg.block_multiple)
        if bs != cfg.block_size:
            log.info("block_size %d -> %d: a DeepSeek-V4 block holds whole compression groups", cfg.block_size, bs)
        # Without snapshots no cached V4 prefix is usable: cache nothing.
        return replace(cfg, block_size=bs, enable_prefix_caching=cfg.enable_prefix_caching and
                       cfg.num_prefix_snapshots != 0)

    @staticmethod
    def _num_snapshots(cfg: EngineConfig) -> int:
        if not cfg.enable_prefix_caching:
            return 0
        return cfg.num_prefix_snapshots if cfg.num_prefix_snapshots is not None else cfg.max_num_seqs

    def _blocks_from_memory(self) -> int:
        kind = HybridKVCache if self.hybrid else KVCache
        per = kind.bytes_per_block(self.model_config, self.cfg.block_size, self.cfg.torch_dtype)
        by_mem = max(1, self.cfg.kv_cache_memory_mb * (1 << 20) // per)
        per_seq = -(-self.max_model_len // self.cfg.block_size) + 2
        return int(min(by_mem, self.cfg.max_num_seqs * per_seq))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def load(self) -> tuple[int, int, int, int, int]:
        """(running, waiting, free blocks, total blocks, tokens still to generate).
        Call only while no step is running."""
        outstanding = sum(max(0, s.params.max_tokens - s.num_output_tokens) for s in self.seqs.values())
        return (len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.num_free_blocks,
                self.blocks.num_blocks, outstanding)

    def pending_prompt_tokens(self) -> int:
        """Prompt tokens admitted but not yet computed. Call only between steps."""
        return sum(max(0, s.num_prompt_tokens - s.num_computed) for s in self.seqs.values())

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.can_overlap or self.lockstep:  # a lockstep rank on its own: every step runs
            return speculative_step(self)
        plan = self.plan_step()
        if plan is None:
            return []
        if plan is spec_overlap.WHOLE:
            return speculative_step(self)
        with torch.inference_mode():
            self.run_step(plan)
        return request_outputs(self.land_step(plan))

    def whole_step(self) -> list[RequestOutput]:
        """An MTP step that spec_overlap does not take, run whole (plan_step said WHOLE)."""
        return speculative_step(self)

    def empty_step(self) -> "PlannedStep | spec_overlap.MTPStep":
        """A lockstep rank's planned step without work (plan_step said None): its forward
        runs on an empty batch, so that its collectives meet the other ranks'."""
        if self.use_mtp:
            return spec_overlap.empty(self, next_step_id())
        batch = build_batch([], self.cfg.block_size, self.device, self.batcher, None, self.tables, self.row_keys)
        step = PlannedStep([], batch, [], [], [], None, None)
        step.stats = StepStats()
        return step

    # ---- planned steps: plan (host) -> run (device thread) -> land (host) ------------
    def plan_step(self, inflight: PlannedStep | None = None) -> PlannedStep | Blocked | None:
        """Schedule and build the next step. With `inflight` (the step the device runs
        now), the plan assumes it landed; nothing is preempted then (BLOCKED instead).
        Returns None when there is nothing to do. With MTP (spec_overlap.py): an MTPStep,
        or spec_overlap.WHOLE for a step that must run whole."""
        if self.use_mtp:
            return spec_overlap.plan(self, inflight, next_step_id())
        t0 = time.perf_counter()
        got = self.schedule_chunks(inflight is None)
        if got is None or got is BLOCKED:
            return got
        st, chunks = got
        t1 = time.perf_counter()
        pad = self.graphs.padding(chunks) if self.graphs is not None else None
        batch = build_batch(chunks, self.cfg.block_size, self.device, self.batcher, pad, self.tables, self.row_keys)
        step = PlannedStep(chunks, batch, [], [], [], None, None)
        step.stats = st
        sid = step.step_id
        if self.snapshots is not None:  # before a fork takes the parent's ring
            step.restores = self._restores(chunks)
            step.snapshots = self._snapshot_plan(chunks, [(c.start + c.q_len,) * 2 for c in chunks])
        seqs, slots, params, rows = step.seqs, step.slots, step.params, []
        fill_rows, fill_from, register, forked = [], [], [], []
        bs = self.cfg.block_size
        for c in chunks:
            seq = c.seq
            q = len(c.token_ids)
            if c.token_ids[-1] == PLACEHOLDER:  # its input is what the step in flight samples
                fill_rows.append(c.row + q - 1)
                fill_from.append(seq.sample_row)
            if seq.cow_src >= 0:  # a child's first step: its copy of the parent's tail block first
                step.release.append(seq.cow_src)
                step.copies.append(take_copy(seq, bs))
            end = seq.num_computed = c.start + q
            if end // bs > seq.num_registered:
                register.append((seq, end))
            if seq.forks:  # a parent samples nothing; once at P-1 it forks, and child 0 registers
                forked += [rid for rid, _ in seq.forks]  # a worker's view: its children were scheduled
                if end == seq.num_tokens - 1:
                    children = self._fork(seq)
                    step.ring_copies += ring_copies(children)
                    if register and register[-1][0] is seq:
                        register[-1] = (children[0], end)
                    if inflight is not None:  # its chunk before lands after the fork: child 0 registers it
                        inflight.register = [(children[0] if s is seq else s, e) for s, e in inflight.register]
                continue
            if end == len(seq.token_ids):  # it reaches its newest token: it samples the next
                rows.append(c.row + q - 1)
                seq.sample_step, seq.sample_row = sid, len(seqs)
                if end >= seq.last_slot or end == seq.num_prompt_tokens or seq.params.stop_token_ids:
                    step.special.append(len(seqs))
                seqs.append(seq)
                slots.append(end)
                params.append(seq.params)
                seq.token_ids.append(PLACEHOLDER)
        if rows and rows[-1] != len(rows) - 1:
            step.sample_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        if fill_rows:
            step.fill_rows = torch.tensor(fill_rows, dtype=torch.long, device=self.device)
            step.fill_from = torch.tensor(fill_from, dtype=torch.long, device=self.device)
        if any(p.seed is not None for p in params):
            step.generators = [self._gen_at(s, slot) for s, slot in zip(seqs, slots)]
        if any(p.logprobs is not None for p in params):
            step.logprobs = [p.logprobs for p in params]
        if self.constrained:
            step.grammar = self.grammar_rows(sid)
        step.prev = inflight
        step.register = register
        st.num_seqs, st.num_decode = len(chunks), batch.num_decode
        st.num_tokens = batch.num_decode if batch.static else batch.num_tokens  # not the padding
        st.scheduled = [c.seq.request_id for c in chunks] + forked
        t2 = time.perf_counter()
        st.schedule_s, st.prepare_s = t1 - t0, t2 - t1
        return step

    def schedule_chunks(self, can_preempt: bool) -> "tuple[StepStats, list[Chunk]] | Blocked | None":
        """The next step's chunks and its stats so far; BLOCKED when only a preemption
        would make room and none is allowed; None (last_stats set) when nothing is to do."""
        sched = self.scheduler.schedule(can_preempt=can_preempt)
        if sched.blocked:
            return BLOCKED
        st = StepStats(preempted=[s.request_id for s in sched.preempted])
        if sched.empty:
            self.last_stats = st
            return None
        return st, [self._chunk(s) for s in sched.scheduled]

    def stop_reason(self, p, token: int, n_out: int, n_tokens: int) -> FinishReason | None:
        """Why a request ends on `token`, its n_out-th output with n_tokens tokens in all
        then; None: it goes on. p: its SamplingParams."""
        if n_out >= p.min_tokens and ((token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids):
            return FinishReason.STOP
        if n_out >= p.max_tokens or n_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def run_step(self, step: PlannedStep, before_wait=None) -> None:
        """The device part (forward, logits, sampling). Safe on another thread while the
        host plans or lands other steps; call it under torch.inference_mode(), which the
        device thread enters once. before_wait: see planned_step.run."""
        if isinstance(step, spec_overlap.MTPStep):
            spec_overlap.run(step, self.model, self.kv.forward_arg, self._gen_at, before_wait)
            return
        run(step, self.model, self.kv.forward_arg, before_wait, self.graphs if step.chunks else None)

    @property
    def device_is_async(self) -> bool:
        """Whether the device computes while the thread that queued the work goes on (a
        GPU, or the mock's fixed step time), rather than on that thread (a CPU)."""
        return self.device.type != "cpu" or hasattr(self.model, "synchronize")

    def land_step(self, step: PlannedStep) -> StepOutputs:
        """Write the step's sampled ids into its sequences, check stops, finish and hold
        requests. Host only: call after run_step has returned."""
        if isinstance(step, spec_overlap.MTPStep):
            return spec_overlap.land(self, step)
        t0 = time.perf_counter()
        st = step.stats
        toks = step.sampled.tolist() if step.seqs else []
        seqs, slots = step.seqs, step.slots
        try:
            for seq, slot, t in zip(seqs, slots, toks):
                seq.token_ids[slot] = t
        except IndexError:  # a sequence that stopped after this step was planned lost its placeholder
            for seq, slot, t in zip(seqs, slots, toks):
                if slot < len(seq.token_ids):
                    seq.token_ids[slot] = t
        for seq, end in step.register:
            if seq.status is SeqStatus.RUNNING:
                self._register(seq, end)
        if step.release:  # the children's copies of their parent's tail block are made
            self.blocks.free(step.release)
        if step.restores:
            self._unpin(step.restores)
        if step.snapshots:
            self._file_snapshots(step.snapshots)
        out = StepOutputs([s.request_id for s in seqs], toks,
                          positions=[slot - s.num_prompt_tokens for s, slot in zip(seqs, slots)])
        live = [s.status is SeqStatus.RUNNING for s in seqs]
        ends = self._ends(step, toks)
        if ends or not all(live):
            out = self._land_rows(step, toks, live, ends)
        st.land_s = time.perf_counter() - t0
        st.forward_s, st.logits_s, st.sample_s = step.forward_s, step.logits_s, step.sample_s
        st.forward_s += st.logits_s  # the LM head is model compute, not sampling
        st.total_s = st.schedule_s + st.prepare_s + step.forward_s + step.sample_s + st.land_s
        self.last_stats = st
        return out

    def _ends(self, step: PlannedStep, toks: list[int]) -> list[int]:
        """Rows that need more than their id written: the request may stop, or the row
        carries logprobs, a prompt's first token, or a prefill hand-off."""
        if not toks:
            return []
        if step.logprobs is not None:
            return list(range(len(toks)))
        eos = torch.isin(step.sampled, self._eos).nonzero().flatten().tolist() if len(self._eos) else []
        return sorted(set(step.special).union(eos)) if eos else step.special

    def _land_rows(self, step: PlannedStep, toks: list[int], live: list[bool], ends: list[int]) -> StepOutputs:
        out = StepOutputs()
        todo = set(ends)
        for i, (seq, slot, t) in enumerate(zip(step.seqs, step.slots, toks)):
            if not live[i]:  # aborted, or stopped by a token it sampled in the step before
                continue
            if i in todo:
                extra = self._land_row(step, i, seq, slot, t)
                if extra is not None:
                    extra.row = len(out.request_ids)
                    out.extras.append(extra)
            out.request_ids.append(seq.request_id)
            out.token_ids.append(t)
            out.positions.append(slot - seq.num_prompt_tokens)
        return out

    def _land_row(self, step: PlannedStep, i: int, seq: Sequence, slot: int, t: int) -> Finished | None:
        p = seq.params
        n_out = slot + 1 - seq.num_prompt_tokens
        extra = Finished(0)
        if slot == seq.num_prompt_tokens:  # its prompt is done (once for a parent's children)
            if not seq.fork_index:
                self.num_prompt_tokens_total += seq.num_prompt_tokens
                self.num_cached_tokens_total += seq.num_cached_tokens
            extra.num_prompt_tokens, extra.num_cached_tokens = seq.num_prompt_tokens, seq.num_cached_tokens
        if step.token_logprobs is not None and step.token_logprobs[i] is not None:
            extra.logprobs = [step.token_logprobs[i]]
        reason = self.stop_reason(p, t, n_out, slot + 1)
        if reason is not None:
            del seq.token_ids[slot + 1 :]  # a placeholder of the step in flight
            self.scheduler.finish(seq, reason)
            extra.finish_reason = reason
            if self.blocks.enable_caching:
                extra.block_hashes = seq.block_hashes[: seq.num_registered]
            self.seqs.pop(seq.request_id, None)
        elif self.cfg.role == "prefill":
            self.scheduler.detach(seq)
            self.seqs.pop(seq.request_id, None)
            self.held[seq.request_id] = seq
            extra.prefill_done = True
        if reason is None and not extra.prefill_done and not extra.logprobs and not extra.num_prompt_tokens:
            return None
        return extra

    # ---- structured output (grammar.py) ---------------------------------------------------
    def _matcher(self, seq: Sequence):
        """A request's grammar state, fed the tokens it has generated (None: no grammar)."""
        if seq.params.grammar is None:
            return None
        try:
            return self.grammar.matcher(seq.params.grammar, seq.output_ids)
        except GrammarError as e:
            raise RequestError(f"response_format: {e}", "response_format") from None

    def grammar_rows(self, step_id: int) -> GrammarRows | None:
        """The constrained rows that the planned step step_id samples. Walks the
        constrained requests only."""
        rows = [(seq.sample_row, seq.matcher) for seq in self.live_constrained() if seq.sample_step == step_id]
        return GrammarRows(self.grammar, rows) if rows else None

    def live_constrained(self) -> list[Sequence]:
        """The constrained requests that may still sample here; forgets those that are
        over (finished, or held for a pull: a held request samples nothing more here)."""
        live = []
        for rid, seq in list(self.constrained.items()):
            if seq.status is SeqStatus.FINISHED or seq.status is SeqStatus.HELD:
                del self.constrained[rid]
            else:
                live.append(seq)
        return live

    def _last_slot(self, seq: Sequence) -> int:
        n_out = 1 if self.cfg.role == "prefill" else seq.params.max_tokens
        return min(seq.num_prompt_tokens + n_out, self.max_model_len) - 1

    def _gen_at(self, seq: Sequence, slot: int) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        return torch.Generator().manual_seed((seq.params.seed * 1_000_003 + slot - seq.num_prompt_tokens)
                                             & (2**63 - 1))

    def _chunk(self, s: ScheduledSeq) -> Chunk:
        seq = s.seq
        if s.num_new_tokens == 1 and not s.num_draft_tokens:
            return Chunk(seq, seq.num_computed, [seq.token_ids[seq.num_computed]])
        n_real = s.num_new_tokens - s.num_draft_tokens
        ids = seq.token_ids[seq.num_computed : seq.num_computed + n_real] + seq.draft_ids[: s.num_draft_tokens]
        return Chunk(seq, seq.num_computed, ids)

    def _register(self, seq: Sequence, through: int | None = None, pending: list[int] = ()) -> None:
        """Put the sequence's newly completed full blocks into the prefix cache. through:
        positions computed (default num_computed); `pending`: tokens whose KV is computed
        but that are not in seq.token_ids yet."""
        if not self.blocks.enable_caching:
            return
        n_full = (seq.num_computed if through is None else through) // self.cfg.block_size
        if n_full <= seq.num_registered:
            return
        tokens = seq.token_ids + list(pending) if pending else seq.token_ids
        seq.block_hashes = chain(tokens, self.cfg.block_size, self.kv_identity, n_full, seq.block_hashes)
        for i in range(seq.num_registered, n_full):
            self.blocks.register(seq.block_ids[i], seq.block_hashes[i])
        seq.num_registered = n_full

    # ---- V4 boundary snapshots (snapshots.py) ---------------------------------------------
    def _restores(self, chunks: list[Chunk]) -> list[tuple[int, int, bytes]]:
        """(snapshot, ring, hash) copies that must precede this step's forward: sequences
        that start on a cached prefix. The snapshots stay pinned until the step has run
        (`_unpin`): an operation between steps may take any unpinned snapshot ring."""
        out = []
        for c in chunks:
            seq = c.seq
            if seq.restore_ring >= 0:
                out.append((seq.restore_ring, seq.ring, seq.restore_hash))
                seq.restore_ring, seq.restore_hash = -1, b""
        return out

    def _unpin(self, restores: list[tuple[int, int, bytes]]) -> None:
        for _, _, h in restores:
            self.snapshots.unpin(h)

    def _snapshot_plan(self, chunks: list[Chunk], ends: list[tuple[int, int]],
                       rings: list[int] | None = None) -> list[tuple[int, int, Sequence, int]]:
        """(ring, snapshot ring, sequence, boundary) copies to make after this step.
        ends: per chunk, positions computed and ring rows written up to (drafts included)."""
        out, bs, ahead = [], self.cfg.block_size, self.kv.layout.ahead
        for i, (c, (end, write_end)) in enumerate(zip(chunks, ends)):
            b = boundary(c.start, end, write_end, bs, ahead)
            if b and (dst := self.snapshots.take()) is not None:
                out.append((c.seq.ring if rings is None else rings[i], dst, c.seq, b))
        return out

    def _file_snapshots(self, snaps: list[tuple[int, int, Sequence, int]]) -> None:
        """Snapshots taken: kept under the hash of the block ending at their boundary when
        that block is cached, else given back."""
        bs = self.cfg.block_size
        for _, dst, seq, b in snaps:
            i = b // bs - 1
            h = seq.block_hashes[i] if i < len(seq.block_hashes) else b""
            if not h or not self.blocks.lookup([h]):
                self.snapshots.give(dst)
                continue
            if not self.snapshots.put(h, dst, b):
                continue
            if b in seq.snap_targets:
                seq.snap_targets.remove(b)
            else:  # the newest boundary of its decode: it supersedes the one before
                if seq.latest_snap:
                    self.snapshots.demote(seq.latest_snap)
                seq.latest_snap = h

    def _gen(self, seq: Sequence) -> torch.Generator | None:
        # Keyed by output position, so a seeded request draws the same numbers whether it
        # is sampled here or on another worker, and however it was batched.
        return self._gen_at(seq, seq.num_tokens)
