"""Admission: the engine's requests by id, from the moment they enter to the moment they
leave.

Lifecycle of an id here: admitted (add_request, or run_prefilled for a request whose
prompt KV came from a prefill worker) -> in `seqs` while waiting or running -> out
through finish() (it stopped, or abort()), or through hold() into `held` (prefill role:
its first token is out, its KV waits for export) -> release().

A parent of n > 1 children computes the prompt once and forks into them when only its
last position is left (fork, engine/fork.py); until then its children's ids are in
`parent_of`. Requests with a grammar are also in `constrained`.

Everything here runs once per request, never per token.
"""

from __future__ import annotations

from typing import Callable

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.errors import RequestError
from moemesh.shared.engine.fork import can_fork, make_children
from moemesh.shared.engine.grammar import GrammarRuntime
from moemesh.shared.engine.prefix_cache import PrefixCache
from moemesh.shared.engine.scheduler import Scheduler
from moemesh.shared.engine.sequence import FinishReason, Sequence, SeqStatus
from moemesh.shared.engine.snapshots import usable_depth
from moemesh.shared.grammar.compile import GrammarError
from moemesh.shared.protocol.messages import PromptLogprobs, SamplingParams


class Admission:
    def __init__(self, scheduler: Scheduler, blocks: BlockManager, prefix: PrefixCache, grammar: GrammarRuntime,
                 *, max_model_len: int, max_num_seqs: int, vocab_size: int, num_spec: int, hybrid: bool,
                 role: str, draft_budget: Callable[[Sequence], int]):
        """num_spec: MTP drafts a step verifies (0: no MTP); hybrid: a DeepSeek-V4 cache,
        whose cached prefixes are usable only as deep as a boundary snapshot (prefix.snapshots);
        draft_budget(seq): drafts a sequence can still use (Drafter.budget)."""
        self.scheduler, self.blocks, self.prefix, self.grammar = scheduler, blocks, prefix, grammar
        self.max_model_len, self.max_num_seqs, self.vocab_size = max_model_len, max_num_seqs, vocab_size
        self.num_spec, self.hybrid, self.role, self.draft_budget = num_spec, hybrid, role, draft_budget
        self.seqs: dict[str, Sequence] = {}  # waiting or running
        self.held: dict[str, Sequence] = {}  # prefill role: done here, KV kept for export
        self.parent_of: dict[str, str] = {}  # child request id -> its parent's, until the fork
        # The running requests with a grammar. Empty (the common case) means a step does
        # no grammar work at all.
        self.constrained: dict[str, Sequence] = {}

    # ---- entry --------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("prompt is empty", "prompt")
        if n >= self.max_model_len:
            raise RequestError(
                f"prompt has {n} tokens but the model's context is {self.max_model_len}; "
                f"prompt plus output must fit", "prompt")
        vocab = self.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        need = self.blocks.blocks_for(min(n + params.max_tokens, self.max_model_len) + 2 * self.num_spec)
        if need > self.blocks.num_blocks:
            raise RequestError(
                f"request needs {need} KV blocks but the cache holds {self.blocks.num_blocks}", "max_tokens")

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, output_ids: list[int] = (),
        cached_blocks: list[int] = (), forks: list[tuple[str, SamplingParams]] = (),
    ) -> None:
        """output_ids: tokens already generated elsewhere (a decode worker recomputing a
        prompt whose KV transfer failed); they are recomputed with the prompt.
        cached_blocks: blocks (references already held, handed over to the request) that
        hold the KV of the prompt's first len(cached_blocks) full blocks.
        forks: parallel sampling, the (request id, params) of n children: request_id
        computes the prompt once and forks into them (engine/fork.py); every output is
        theirs. `params` is then unused."""
        if forks:
            return self._add_parent(request_id, list(prompt_ids), list(forks), list(cached_blocks))
        if self._known(request_id):
            raise RequestError(f"duplicate request id {request_id!r}")
        self.check_request(prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids) + list(output_ids), params, num_prompt_tokens=len(prompt_ids))
        seq.last_slot = self._last_slot(seq)
        seq.matcher = self._matcher(seq)
        seq.block_hashes = self.prefix.hashes(seq.token_ids)
        if params.prompt_logprobs is not None and not output_ids:
            seq.prompt_logprobs = PromptLogprobs.empty(len(prompt_ids), params.prompt_logprobs)
            if cached_blocks:  # scored positions are computed here, never taken from a cache
                self.blocks.free(list(cached_blocks))
                cached_blocks = ()
        if cached_blocks:
            bs = self.blocks.block_size
            if len(cached_blocks) * bs >= len(seq.token_ids):
                raise RequestError("cached blocks must leave at least one prompt token to compute")
            d = usable_depth(self.prefix.snapshots, seq.block_hashes[: len(cached_blocks)], self.hybrid)
            if d < len(cached_blocks):  # V4: usable only as deep as a boundary snapshot
                self.blocks.free(list(cached_blocks[d:]))
                cached_blocks = cached_blocks[:d]
        if cached_blocks:
            seq.block_ids = list(cached_blocks)
            seq.num_computed = len(cached_blocks) * bs
            seq.num_registered = len(cached_blocks)
            seq.num_cached_tokens = seq.num_computed
            if self.prefix.snapshots is not None:
                self.scheduler.pin_snapshot(seq)
        self.seqs[request_id] = seq
        if seq.matcher is not None:
            self.constrained[request_id] = seq
        self.scheduler.add(seq)

    def _known(self, request_id: str) -> bool:
        return request_id in self.seqs or request_id in self.held or request_id in self.parent_of

    def _add_parent(self, request_id: str, prompt_ids: list[int], forks: list[tuple[str, SamplingParams]],
                    cached_blocks: list[int]) -> None:
        ids = [request_id] + [rid for rid, _ in forks]
        if len(set(ids)) < len(ids) or any(self._known(r) for r in ids):
            raise RequestError(f"duplicate request id among {ids!r}")
        if len(forks) > self.max_num_seqs:
            raise RequestError(f"n = {len(forks)} is more than the {self.max_num_seqs} sequences a step "
                               f"holds here", "n")
        for _, p in forks:
            self.check_request(prompt_ids, p)
        if len(forks) == 1 or not can_fork(len(prompt_ids)):  # a one-token prompt: the children compute it each
            for i, (rid, p) in enumerate(forks):
                self.add_request(rid, prompt_ids, p, cached_blocks=cached_blocks if i == 0 else ())
            return
        keep = (len(prompt_ids) - 2) // self.blocks.block_size  # the parent computes up to P-2
        if len(cached_blocks) > keep:
            self.blocks.free(cached_blocks[keep:])
            cached_blocks = cached_blocks[:keep]
        self.add_request(request_id, prompt_ids, forks[0][1], cached_blocks=cached_blocks)
        self.seqs[request_id].forks = forks
        for rid, _ in forks:
            self.parent_of[rid] = request_id

    def check_prefilled(self, request_id: str, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams,
                        draft_ids: list[int] = ()) -> None:
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        self.check_request(token_ids[:num_prompt_tokens], params)
        if len(token_ids) <= num_prompt_tokens:
            raise RequestError("a prefilled request must carry its first sampled token")
        if draft_ids and not all(0 <= d < self.vocab_size for d in draft_ids):
            raise RequestError(f"draft token ids must be in [0, {self.vocab_size})")

    def run_prefilled(self, request_id: str, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams,
                      block_ids: list[int], ring: int = -1, draft_ids: list[int] = ()) -> None:
        """A checked prefilled request whose prompt KV is in block_ids (references handed
        over to it) joins the running sequences."""
        seq = Sequence(request_id, list(token_ids), params, num_prompt_tokens=num_prompt_tokens)
        seq.last_slot = self._last_slot(seq)
        try:
            seq.matcher = self._matcher(seq)
        except RequestError:  # output that breaks its grammar: the blocks handed over go back
            self.blocks.free(block_ids)
            if ring >= 0:
                self.blocks.give_ring(ring)
            raise
        seq.block_ids, seq.ring = block_ids, ring
        seq.num_computed = len(token_ids) - 1
        if self.num_spec:
            seq.draft_ids = list(draft_ids[: min(self.num_spec, self.draft_budget(seq))])
        seq.block_hashes = self.prefix.hashes(seq.token_ids)
        self.prefix.register(seq)
        self.seqs[request_id] = seq
        if seq.matcher is not None:
            self.constrained[request_id] = seq
        self.scheduler.add_running(seq)

    # ---- while it runs ----------------------------------------------------------------
    def fork(self, parent: Sequence) -> list[Sequence]:
        """The parent has computed its prompt but the last position: its children take its
        place (engine/fork.py). On V4 the caller copies the parent's ring into the
        children's (fork.ring_copies) once that position's forward has run."""
        children = make_children(parent, self.blocks, self._last_slot)
        self.scheduler.fork(parent, children)
        del self.seqs[parent.request_id]
        self.constrained.pop(parent.request_id, None)
        for child in children:
            self.parent_of.pop(child.request_id, None)
            self.seqs[child.request_id] = child
            child.matcher = self._matcher(child)  # its own grammar state (the parent's spec was checked)
            if child.matcher is not None:
                self.constrained[child.request_id] = child
        return children

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

    # ---- exit ---------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """A running request stopped: its blocks go back (scheduler.finish)."""
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)

    def hold(self, seq: Sequence) -> None:
        """Prefill role: a request whose first token is out keeps its blocks for export."""
        self.scheduler.detach(seq)
        self.seqs.pop(seq.request_id, None)
        self.held[seq.request_id] = seq

    def abort(self, request_id: str) -> bool:
        """A request, a parent (with its children), one child of a parent not forked yet,
        or a held request."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            for rid, _ in seq.forks:
                self.parent_of.pop(rid, None)
            self.scheduler.finish(seq, FinishReason.ABORT)
            return True
        parent_id = self.parent_of.pop(request_id, None)
        if parent_id is not None:
            parent = self.seqs[parent_id]
            parent.forks = [f for f in parent.forks if f[0] != request_id]
            if not parent.forks:
                self.abort(parent_id)
            return True
        return self.release(request_id)

    def release(self, request_id: str) -> bool:
        """A held request's blocks go back (its KV was pulled, or it is given up)."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.blocks.free(seq.block_ids)
        seq.block_ids = []
        if seq.ring >= 0:
            self.blocks.give_ring(seq.ring)
            seq.ring = -1
        seq.status = SeqStatus.FINISHED
        return True

    # ---- per request ----------------------------------------------------------------------
    def _matcher(self, seq: Sequence):
        """A request's grammar state, fed the tokens it has generated (None: no grammar)."""
        if seq.params.grammar is None:
            return None
        try:
            return self.grammar.matcher(seq.params.grammar, seq.output_ids)
        except GrammarError as e:
            raise RequestError(f"response_format: {e}", "response_format") from None

    def _last_slot(self, seq: Sequence) -> int:
        n_out = 1 if self.role == "prefill" else seq.params.max_tokens
        return min(seq.num_prompt_tokens + n_out, self.max_model_len) - 1
