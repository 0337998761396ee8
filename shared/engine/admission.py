"""Admission: a request (or a parent of n children) enters the engine, or leaves it.

check_request() is every entry's check (the prompt fits the context and the vocabulary,
the request fits the cache); add_request() makes the request's Sequence, with the
blocks of a cached prefix already held; a parent of n > 1 children computes the prompt
once and forks into them when only its last position is left (_fork, engine/fork.py);
abort() takes out a request, a parent with its children, or one child not forked yet.
LLMEngine takes these methods from Admission; they run once per request, never per
token.
"""

from __future__ import annotations

from moemesh.shared.engine.errors import RequestError
from moemesh.shared.engine.fork import can_fork, make_children
from moemesh.shared.engine.sequence import FinishReason, Sequence
from moemesh.shared.protocol.prefix_hash import chain
from moemesh.shared.protocol.sampling import SamplingParams


class Admission:
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("prompt is empty", "prompt")
        if n >= self.max_model_len:
            raise RequestError(
                f"prompt has {n} tokens but the model's context is {self.max_model_len}; "
                f"prompt plus output must fit", "prompt")
        vocab = self.model_config.vocab_size
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
        if request_id in self.seqs or request_id in self.held or request_id in self._parent_of:
            raise RequestError(f"duplicate request id {request_id!r}")
        self.check_request(prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids) + list(output_ids), params, num_prompt_tokens=len(prompt_ids))
        seq.last_slot = self._last_slot(seq)
        seq.matcher = self._matcher(seq)
        seq.block_hashes = chain(seq.token_ids, self.cfg.block_size, self.kv_identity)
        if cached_blocks:
            bs = self.cfg.block_size
            if len(cached_blocks) * bs >= len(seq.token_ids):
                raise RequestError("cached blocks must leave at least one prompt token to compute")
            if self.hybrid:  # V4: usable only as deep as a boundary snapshot
                d = self.snapshots.usable(seq.block_hashes[: len(cached_blocks)]) if self.snapshots else 0
                self.blocks.free(list(cached_blocks[d:]))
                cached_blocks = cached_blocks[:d]
        if cached_blocks:
            seq.block_ids = list(cached_blocks)
            seq.num_computed = len(cached_blocks) * bs
            seq.num_registered = len(cached_blocks)
            seq.num_cached_tokens = seq.num_computed
            if self.snapshots is not None:
                self.scheduler.pin_snapshot(seq)
        self.seqs[request_id] = seq
        if seq.matcher is not None:
            self.constrained[request_id] = seq
        self.scheduler.add(seq)

    def _add_parent(self, request_id: str, prompt_ids: list[int], forks: list[tuple[str, SamplingParams]],
                    cached_blocks: list[int]) -> None:
        ids = [request_id] + [rid for rid, _ in forks]
        if len(set(ids)) < len(ids) or any(r in self.seqs or r in self.held or r in self._parent_of for r in ids):
            raise RequestError(f"duplicate request id among {ids!r}")
        if len(forks) > self.cfg.max_num_seqs:
            raise RequestError(f"n = {len(forks)} is more than the {self.cfg.max_num_seqs} sequences a step "
                               f"holds here", "n")
        for _, p in forks:
            self.check_request(prompt_ids, p)
        if len(forks) == 1 or not can_fork(len(prompt_ids)):  # a one-token prompt: the children compute it each
            for i, (rid, p) in enumerate(forks):
                self.add_request(rid, prompt_ids, p, cached_blocks=cached_blocks if i == 0 else ())
            return
        keep = (len(prompt_ids) - 2) // self.cfg.block_size  # the parent computes up to P-2
        if len(cached_blocks) > keep:
            self.blocks.free(cached_blocks[keep:])
            cached_blocks = cached_blocks[:keep]
        self.add_request(request_id, prompt_ids, forks[0][1], cached_blocks=cached_blocks)
        self.seqs[request_id].forks = forks
        for rid, _ in forks:
            self._parent_of[rid] = request_id

    def abort(self, request_id: str) -> bool:
        """A request, a parent (with its children), or one child of a parent not forked yet."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            for rid, _ in seq.forks:
                self._parent_of.pop(rid, None)
            self.scheduler.finish(seq, FinishReason.ABORT)
            return True
        parent_id = self._parent_of.pop(request_id, None)
        if parent_id is not None:
            parent = self.seqs[parent_id]
            parent.forks = [f for f in parent.forks if f[0] != request_id]
            if not parent.forks:
                self.abort(parent_id)
            return True
        return self.release(request_id)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The parent has computed its prompt but the last position: its children take its
        place (engine/fork.py). On V4 the caller copies the parent's ring into the
        children's (fork.ring_copies) once that position's forward has run."""
        children = make_children(parent, self.blocks, self._last_slot)
        self.scheduler.fork(parent, children)
        del self.seqs[parent.request_id]
        self.constrained.pop(parent.request_id, None)
        for child in children:
            self._parent_of.pop(child.request_id, None)
            self.seqs[child.request_id] = child
            child.matcher = self._matcher(child)  # its own grammar state (the parent's spec was checked)
            if child.matcher is not None:
                self.constrained[child.request_id] = child
        return children
