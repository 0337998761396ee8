"""The engine's prefill and decode roles: hand a held request's KV out, take one in.

A prefill engine stops a request after its first token and HOLDS it; export_kv() gives
its blocks as one contiguous buffer (kv_shape), release() frees them. A decode engine's
add_prefilled() imports such a buffer and the request goes on decoding as if its prompt
had been computed here. LLMEngine takes these methods from KVHandoff; they read the
engine's block manager, cache and scheduler, and change nothing else.
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.errors import NoCapacity, RequestError
from moemesh.shared.engine.sequence import Sequence, SeqStatus
from moemesh.shared.protocol.prefix_hash import chain
from moemesh.shared.protocol.sampling import SamplingParams


class KVHandoff:
    def export_kv(self, request_id: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The held request's computed prefix as one buffer of kv_shape(n_blocks):
        [num_cache_layers, n_blocks, block_size, D] for MLA; for V4 the main rows and
        the window rows it needs to go on (hybrid_cache.py)."""
        seq = self.held[request_id]
        n = self.blocks.blocks_for(seq.num_computed)
        if self.hybrid:
            return self.kv.export(seq.block_ids[:n], seq.ring, seq.num_computed, out)
        return self.kv.export_blocks(seq.block_ids[:n], out)

    def kv_shape(self, n_blocks: int, num_carries: int = 1) -> tuple[int, ...]:
        """Shape of the buffer export_kv fills for a prefix of n_blocks blocks. V4:
        num_carries sequences' ring look-backs after them (children moved together,
        engine/fork_io.py, carry one each); MLA carries nothing besides its blocks."""
        if self.hybrid:
            return self.kv.export_shape(n_blocks, num_carries)
        layers, _, bs, d = self.kv.tensor.shape
        return (layers, n_blocks, bs, d)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.cfg.torch_dtype

    def held_sequence(self, request_id: str) -> Sequence:
        return self.held[request_id]

    def held_drafts(self, request_id: str) -> list[int]:
        """The MTP drafts proposed for a held request's first decode step, to hand off with
        its KV: they come from its last prompt position's hidden state, which only this
        engine has (empty without MTP)."""
        self.drafter.resolve()
        return list(self.held[request_id].draft_ids)

    def release(self, request_id: str) -> bool:
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

    def can_import(self, num_prompt_tokens: int) -> bool:
        if self.blocks.uses_rings and not self.blocks.num_free_rings:
            return False
        return self.blocks.can_allocate(self.blocks.blocks_for(num_prompt_tokens))

    def add_prefilled(
        self, request_id: str, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams, kv: torch.Tensor,
        draft_ids: list[int] = (),
    ) -> None:
        """Continue a request whose prompt KV was computed elsewhere. token_ids = prompt
        plus the tokens sampled there (at least the first). draft_ids: the MTP drafts the
        prefill side proposed after the last of them (held_drafts), for the first step to
        verify; those past this engine's num_spec or the request's budget are dropped."""
        self.check_prefilled(request_id, token_ids, num_prompt_tokens, params, draft_ids)
        n_blocks = self.blocks.blocks_for(num_prompt_tokens)
        if tuple(kv.shape) != self.kv_shape(n_blocks):
            raise RequestError(f"KV buffer has shape {tuple(kv.shape)}, {self.kv_shape(n_blocks)} expected "
                               f"for {n_blocks} blocks")
        if not self.can_import(num_prompt_tokens):
            raise NoCapacity(f"{n_blocks} KV blocks needed, {self.blocks.num_free_blocks} free")
        block_ids, ring = self.blocks.allocate(n_blocks), -1
        try:
            if self.hybrid:
                ring = self.blocks.take_ring()
                self.kv.import_(block_ids, ring, num_prompt_tokens, kv)
            else:
                self.kv.import_blocks(block_ids, kv)
        except Exception:
            self.blocks.free(block_ids)
            if ring >= 0:
                self.blocks.give_ring(ring)
            raise
        self.run_prefilled(request_id, token_ids, num_prompt_tokens, params, block_ids, ring, draft_ids)

    def check_prefilled(self, request_id: str, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams,
                        draft_ids: list[int] = ()) -> None:
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        self.check_request(token_ids[:num_prompt_tokens], params)
        if len(token_ids) <= num_prompt_tokens:
            raise RequestError("a prefilled request must carry its first sampled token")
        if draft_ids and not all(0 <= d < self.model_config.vocab_size for d in draft_ids):
            raise RequestError(f"draft token ids must be in [0, {self.model_config.vocab_size})")

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
        if self.use_mtp:
            seq.draft_ids = list(draft_ids[: min(self.num_spec, self.drafter.budget(seq))])
        seq.block_hashes = chain(seq.token_ids, self.cfg.block_size, self.kv_identity)
        self._register(seq)
        self.seqs[request_id] = seq
        if seq.matcher is not None:
            self.constrained[request_id] = seq
        self.scheduler.add_running(seq)
