"""MTP drafting after each target step.

The MTP layer runs over every position the target just computed (which also fills the
MTP layer's KV), and for sequences that will decode next it chains `num_spec` greedy
drafts. Under expert parallelism every rank must run the same number of MTP forwards
in every step, since each one holds collectives in its MoE layer; `lockstep` makes the
pass count fixed (1 + num_spec - 1), running empty batches where a rank has no work.

A prefill engine drafts too, for the requests it has just held: their first drafts come
from the last prompt position's hidden state, which only it has. They travel with the
KV hand-off (LLMEngine.held_drafts, KVReadyItem.draft_ids), so the decode worker's first
step verifies them as an offline engine's does. The MTP layer's own KV of the prompt is
a cache layer like the others (the last one; for V4, windows in the ring) and travels
with the rest.
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.runner import Chunk, build_batch
from moemesh.shared.engine.sequence import Sequence, SeqStatus
from moemesh.shared.model.deepseek import DeepseekForCausalLM

# HELD: a prefill worker's request whose first token is out; its drafts go with its KV.
_DRAFTING = (SeqStatus.RUNNING, SeqStatus.HELD)


class Drafter:
    def __init__(self, model: DeepseekForCausalLM, kv, block_size: int, num_spec: int,
                 max_model_len: int, device, lockstep: bool = False, batcher=None):
        """kv: the model's cache argument; batcher: a V4 engine's window-only HybridBatcher."""
        self.model, self.kv, self.block_size, self.batcher = model, kv, block_size, batcher
        self.num_spec, self.max_model_len, self.device, self.lockstep = num_spec, max_model_len, device, lockstep

    def propose(self, work: list[tuple[Chunk, int]], hidden: torch.Tensor) -> None:
        """work: (target chunk, number of its positions whose KV is now valid)."""
        chunks, prev_rows = [], {}
        for c, n_valid in work:
            if c.seq.status == SeqStatus.FINISHED:
                continue
            chunks.append(Chunk(c.seq, c.start, c.seq.token_ids[c.start + 1 : c.start + n_valid + 1]))
            prev_rows[id(c.seq)] = range(c.row, c.row + n_valid)
        if not chunks and not self.lockstep:
            return
        batch = build_batch(chunks, self.block_size, self.device, self.batcher)  # may reorder the chunks
        rows = [r for ch in chunks for r in prev_rows[id(ch.seq)]]  # one index tensor, not one per sequence
        prev = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)] if rows else hidden[:0]
        h = self.model.mtp_forward(batch, prev, self.kv)
        want = [ch for ch in chunks if ch.seq.status in _DRAFTING and ch.seq.in_decode and self.num_spec]
        for step in range(self.num_spec):
            live = [ch for ch in want if len(ch.seq.draft_ids) == step and self.budget(ch.seq) > step]
            if not live and not self.lockstep:
                return
            last = torch.tensor([ch.row + ch.q_len - 1 for ch in live], dtype=torch.long)
            drafts = self.model.mtp_logits(h[last]).argmax(dim=-1).tolist() if live else []
            for ch, d in zip(live, drafts):
                ch.seq.draft_ids.append(d)
            if step + 1 == self.num_spec:
                return
            nxt = [Chunk(ch.seq, ch.seq.num_tokens - 1 + step, [d]) for ch, d in zip(live, drafts)]
            prev_h = h[last]
            batch = build_batch(nxt, self.block_size, self.device, self.batcher)  # all q_len 1: order kept
            h = self.model.mtp_forward(batch, prev_h, self.kv)
            want = nxt

    def budget(self, seq: Sequence) -> int:
        """Draft tokens the sequence can still use: its output and context left after the
        token the next step samples."""
        left_out = seq.params.max_tokens - seq.num_output_tokens - 1
        left_ctx = self.max_model_len - seq.num_tokens - 1
        return max(0, min(left_out, left_ctx))
