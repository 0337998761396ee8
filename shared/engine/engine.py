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

The engine owns its parts and composes them; none of them holds the engine:
- scheduler.py: the waiting and running queues, what each step computes.
- admission.py: the requests by id, from add_request to their finish, hold or abort;
  the fork of n > 1 children.
- handoff.py: a held request's KV out as one buffer, a prefilled request's in.
- prefix_cache.py: full blocks registered under their hashes, V4 boundary snapshots.
- speculative.py: the whole step. planned_step.py and spec_overlap.py: planned steps
  (spec_overlap's plan and land are functions of the engine, not a part of it).
Admission and hand-off run per request, this file per step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

import torch

from moemesh.shared.checkpoint.loader import load_model
from moemesh.shared.engine.admission import Admission
from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.decode_graphs import DecodeGraphs
from moemesh.shared.engine.drafter import Drafter
from moemesh.shared.engine.errors import NoCapacity, RequestError
from moemesh.shared.engine.fork import ring_copies, take_copy
from moemesh.shared.engine.grammar import GrammarRows, GrammarRuntime
from moemesh.shared.engine.handoff import KVHandoff
from moemesh.shared.engine.host_copy import to_device
from moemesh.shared.engine.hybrid_batch import HybridBatcher
from moemesh.shared.engine.hybrid_cache import HybridKVCache
from moemesh.shared.engine.kv_cache import KVCache
from moemesh.shared.engine.outputs import (
    Finished, RequestOutput, StepOutputs, StepStats, request_outputs, step_outputs,
)
from moemesh.shared.engine.planned_step import BLOCKED, Blocked, PlannedStep, next_step_id, run
from moemesh.shared.engine.prefix_cache import PrefixCache
from moemesh.shared.protocol.prefix_hash import kv_identity
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.shared.engine.block_table import BlockTables
from moemesh.shared.engine.runner import Chunk, Padding, build_batch
from moemesh.shared.engine.scheduler import Scheduler, SchedulerConfig
from moemesh.shared.engine.snapshots import SnapshotCache
from moemesh.shared.engine import prompt_scores, spec_overlap
from moemesh.shared.engine.speculative import WholeStep
from moemesh.shared.engine.sequence import PLACEHOLDER, Sequence, SeqStatus, StopRule
from moemesh.shared.model.batch import ForwardBatch
from moemesh.shared.model.deepseek import DeepseekForCausalLM
from moemesh.shared.model.v4.model import DeepseekV4ForCausalLM

log = logging.getLogger(__name__)

__all__ = ["BLOCKED", "Blocked", "LLMEngine", "NoCapacity", "RequestError"]


class LLMEngine:
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
        bs, device, batcher, tables, keys = cfg.block_size, self.device, self.batcher, self.tables, self.row_keys

        def build(chunks: list[Chunk], pad: Padding | None = None) -> ForwardBatch:
            return build_batch(chunks, bs, device, batcher, pad, tables, keys)

        self.kv_identity = kv_identity(mcfg.identity(), cfg.block_size, cfg.dtype)
        sched_cfg = SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.num_spec)
        self.scheduler = Scheduler(sched_cfg, self.blocks, self.snapshots)
        self.eos_ids = set(mcfg.eos_token_ids)
        self._eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        self.stop_reason = StopRule(frozenset(self.eos_ids), self.max_model_len)
        self.graphs = self._decode_graphs(build)
        self.overlap_mtp = False  # set below, once the engine is whole
        self.drafter = Drafter(self.model, self.kv.forward_arg, cfg.block_size, self.num_spec, self.max_model_len,
                               self.device, lockstep, self.draft_batcher, self.tables, self.row_keys)
        self.last_stats = StepStats()
        self.num_drafted_total = 0
        self.num_accepted_total = 0
        self.num_prompt_tokens_total = 0
        self.num_cached_tokens_total = 0  # prompt tokens whose KV came from the prefix cache
        self.grammar = GrammarRuntime(cfg.model, mcfg.vocab_size, self.eos_ids)
        self.prefix = PrefixCache(self.blocks, self.kv_identity, self.snapshots,
                                  self.kv.layout.ahead if self.hybrid else 0)
        self.admission = Admission(self.scheduler, self.blocks, self.prefix, self.grammar,
                                   max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs,
                                   vocab_size=mcfg.vocab_size, num_spec=self.num_spec, hybrid=self.hybrid,
                                   role=cfg.role, draft_budget=self.drafter.budget)
        self.handoff = KVHandoff(self.kv, self.blocks, cfg.torch_dtype)
        self.whole = WholeStep(self.model, self.kv, build, self.scheduler, self.blocks, self.admission, self.prefix,
                               self.drafter, self.grammar, self.stop_reason, num_spec=self.num_spec,
                               lockstep=lockstep, role=cfg.role)
        self.overlap_mtp = spec_overlap.eligible(self)

    def _decode_graphs(self, build) -> DecodeGraphs | None:
        """The decode path of fixed shapes (decode_graphs.py); None: off. build(chunks,
        pad): the engine's batch of chunks."""
        mode = self.cfg.decode_graphs
        capture = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        if mode == "off" or (mode == "auto" and not capture) \
                or not isinstance(self.model, (DeepseekForCausalLM, DeepseekV4ForCausalLM)):
            return None
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
        outstanding = sum(max(0, s.params.max_tokens - s.num_output_tokens) for s in self.admission.seqs.values())
        return (len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.num_free_blocks,
                self.blocks.num_blocks, outstanding)

    def pending_prompt_tokens(self) -> int:
        """Prompt tokens admitted but not yet computed. Call only between steps."""
        return sum(max(0, s.num_prompt_tokens - s.num_computed) for s in self.admission.seqs.values())

    # ---- the KV blocks (block_manager.py), as a worker asks about them ------------------
    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that num_tokens positions take."""
        return self.blocks.blocks_for(num_tokens)

    def drain_kv_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed): hashes of the blocks that entered or left the prefix cache
        since the last drain."""
        return self.blocks.drain_events()

    def cached_hashes(self) -> list[bytes]:
        """Hashes of every block in the prefix cache."""
        return self.blocks.cached_hashes()

    # ---- requests: admission.py, handoff.py ---------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.admission.check_request(prompt_ids, params)

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, output_ids: list[int] = (),
        cached_blocks: list[int] = (), forks: list[tuple[str, SamplingParams]] = (),
    ) -> None:
        """See Admission.add_request."""
        self.admission.add_request(request_id, prompt_ids, params, output_ids, cached_blocks, forks)

    def abort(self, request_id: str) -> bool:
        """A request, a parent (with its children), one child of a parent not forked yet,
        or a held request."""
        return self.admission.abort(request_id)

    def export_kv(self, request_id: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The held request's computed prefix as one buffer of kv_shape(n_blocks)."""
        return self.handoff.export(self.admission.held[request_id], out)

    def kv_shape(self, n_blocks: int, num_carries: int = 1) -> tuple[int, ...]:
        return self.handoff.shape(n_blocks, num_carries)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.handoff.dtype

    def held_sequence(self, request_id: str) -> Sequence:
        return self.admission.held[request_id]

    def held_drafts(self, request_id: str) -> list[int]:
        """The MTP drafts proposed for a held request's first decode step, to hand off with
        its KV: they come from its last prompt position's hidden state, which only this
        engine has (empty without MTP)."""
        self.drafter.resolve()
        return list(self.admission.held[request_id].draft_ids)

    def release(self, request_id: str) -> bool:
        return self.admission.release(request_id)

    def can_import(self, num_prompt_tokens: int) -> bool:
        return self.handoff.can_import(num_prompt_tokens)

    def add_prefilled(
        self, request_id: str, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams, kv: torch.Tensor,
        draft_ids: list[int] = (),
    ) -> None:
        """Continue a request whose prompt KV was computed elsewhere. token_ids = prompt
        plus the tokens sampled there (at least the first). draft_ids: the MTP drafts the
        prefill side proposed after the last of them (held_drafts), for the first step to
        verify; those past this engine's num_spec or the request's budget are dropped."""
        self.admission.check_prefilled(request_id, token_ids, num_prompt_tokens, params, draft_ids)
        block_ids, ring = self.handoff.import_(num_prompt_tokens, kv)
        self.admission.run_prefilled(request_id, token_ids, num_prompt_tokens, params, block_ids, ring, draft_ids)

    # The request tables, read by tests and benches between steps.
    @property
    def seqs(self) -> dict[str, Sequence]:
        return self.admission.seqs

    @property
    def held(self) -> dict[str, Sequence]:
        return self.admission.held

    @property
    def constrained(self) -> dict[str, Sequence]:
        return self.admission.constrained

    @property
    def _parent_of(self) -> dict[str, str]:
        return self.admission.parent_of

    def live_constrained(self) -> list[Sequence]:
        return self.admission.live_constrained()

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.can_overlap or self.lockstep:  # a lockstep rank on its own: every step runs
            return self.whole_step()
        plan = self.plan_step()
        if plan is None:
            return []
        if plan is spec_overlap.WHOLE:
            return self.whole_step()
        with torch.inference_mode():
            self.run_step(plan)
        return request_outputs(self.land_step(plan))

    # A step's outputs two ways: per request (step(), whole_step()) and by column
    # (land_step(), the serving path's view).
    @staticmethod
    def columns(outs: list[RequestOutput]) -> StepOutputs:
        """Per-request outputs by column."""
        return step_outputs(outs)

    @staticmethod
    def by_request(out: StepOutputs) -> list[RequestOutput]:
        """A step's columns per request."""
        return request_outputs(out)

    def whole_step(self) -> list[RequestOutput]:
        """A step run whole (speculative.py): an MTP step that spec_overlap does not take
        (plan_step said WHOLE), or any step where steps do not overlap."""
        outputs, st = self.whole.step()
        self._account(st)
        return outputs

    def _account(self, st: StepStats) -> None:
        """A finished step's stats become the last, its counts join the totals."""
        self.last_stats = st
        self.num_drafted_total += st.num_drafted
        self.num_accepted_total += st.num_accepted
        self.num_prompt_tokens_total += st.num_prompt_tokens
        self.num_cached_tokens_total += st.num_cached_tokens

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
    # A serving loop that overlaps steps tells the engine which are in flight: blocks
    # freed meanwhile are handed out again only once the steps that may write them are done.
    def begin_step(self, step_id: int) -> None:
        """Planned step step_id (ids increase) is queued to run."""
        self.blocks.begin_step(step_id)

    def end_step(self, step_id: int) -> None:
        """The steps up to step_id have run (call before landing them)."""
        self.blocks.end_step(step_id)

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
            step.restores = self.prefix.restores(chunks)
            step.snapshots = self.prefix.snapshot_plan(chunks, [(c.start + c.q_len,) * 2 for c in chunks])
        seqs, slots, params, rows = step.seqs, step.slots, step.params, []
        fill_rows, fill_from, register, forked = [], [], [], []
        bs = self.cfg.block_size
        for c in chunks:
            seq = c.seq
            if seq.prompt_logprobs is not None and (scored := prompt_scores.rows_of(c)) is not None:
                step.scoring.append(scored)
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
                    children = self.admission.fork(seq)
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
            step.sample_rows = to_device(rows, torch.long, self.device)
        if fill_rows:
            step.fill_rows = to_device(fill_rows, torch.long, self.device)
            step.fill_from = to_device(fill_from, torch.long, self.device)
        if any(p.seed is not None for p in params):
            step.generators = [s.generator_at(slot) for s, slot in zip(seqs, slots)]
        if any(p.logprobs is not None for p in params):
            step.logprobs = [p.logprobs for p in params]
        if self.admission.constrained:
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
        return st, [s.chunk() for s in sched.scheduled]

    def run_step(self, step: PlannedStep, before_wait=None) -> None:
        """The device part (forward, logits, sampling). Safe on another thread while the
        host plans or lands other steps; call it under torch.inference_mode(), which the
        device thread enters once. before_wait: see planned_step.run."""
        if isinstance(step, spec_overlap.MTPStep):
            spec_overlap.run(step, self.model, self.kv.forward_arg, before_wait)
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
            out = spec_overlap.land(self, step)
            self._account(step.stats)
            return out
        t0 = time.perf_counter()
        st = step.stats
        if step.scoring:  # before the rows: a first token takes its prompt's scores with it
            prompt_scores.file(step.scoring, step.scores)
        toks = step.sampled.tolist() if step.seqs else []
        seqs, slots = step.seqs, step.slots
        try:
            for seq, slot, t in zip(seqs, slots, toks):
                seq.token_ids[slot] = t
        except IndexError:  # a sequence that stopped after this step was planned lost its placeholder
            for seq, slot, t in zip(seqs, slots, toks):
                if slot < len(seq.token_ids):
                    seq.token_ids[slot] = t
        register = self.prefix.register
        for seq, end in step.register:
            if seq.status is SeqStatus.RUNNING:
                register(seq, end)
        if step.release:  # the children's copies of their parent's tail block are made
            self.blocks.free(step.release)
        if step.restores:
            self.prefix.unpin(step.restores)
        if step.snapshots:
            self.prefix.file_snapshots(step.snapshots)
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
        self._account(st)
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
                step.stats.num_prompt_tokens += seq.num_prompt_tokens
                step.stats.num_cached_tokens += seq.num_cached_tokens
            extra.num_prompt_tokens, extra.num_cached_tokens = seq.num_prompt_tokens, seq.num_cached_tokens
            extra.prompt_logprobs = seq.prompt_logprobs
        if step.token_logprobs is not None and step.token_logprobs[i] is not None:
            extra.logprobs = [step.token_logprobs[i]]
        reason = self.stop_reason(p, t, n_out, slot + 1)
        if reason is not None:
            del seq.token_ids[slot + 1 :]  # a placeholder of the step in flight
            self.admission.finish(seq, reason)
            extra.finish_reason = reason
            if self.blocks.enable_caching:
                extra.block_hashes = seq.block_hashes[: seq.num_registered]
        elif self.cfg.role == "prefill":
            self.admission.hold(seq)
            extra.prefill_done = True
        if reason is None and not extra.prefill_done and not extra.logprobs and not extra.num_prompt_tokens:
            return None
        return extra

    # ---- structured output (grammar.py) ---------------------------------------------------
    def grammar_rows(self, step_id: int) -> GrammarRows | None:
        """The constrained rows that the planned step step_id samples. Walks the
        constrained requests only."""
        rows = [(seq.sample_row, seq.matcher) for seq in self.admission.live_constrained()
                if seq.sample_step == step_id]
        return GrammarRows(self.grammar, rows) if rows else None
