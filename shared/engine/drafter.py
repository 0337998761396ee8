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

from moemesh.shared.engine import host_copy
from moemesh.shared.engine.runner import Chunk, build_batch
from moemesh.shared.engine.sequence import PLACEHOLDER, Sequence, SeqStatus
from moemesh.shared.model.deepseek import DeepseekForCausalLM

# HELD: a prefill worker's request whose first token is out; its drafts go with its KV.
_DRAFTING = (SeqStatus.RUNNING, SeqStatus.HELD)


class Drafter:
    """Proposes drafts on the device and leaves them there: the step that verifies them
    takes them into its input ids on the device (fill) and reads them with its logits
    (resolve), so no draft pass waits on the host. Until then a sequence's draft_ids
    hold PLACEHOLDER, one per draft: their number is all the scheduler needs."""

    def __init__(self, model: DeepseekForCausalLM, kv, block_size: int, num_spec: int,
                 max_model_len: int, device, lockstep: bool = False, batcher=None, tables=None,
                 row_keys: bool = False):
        """kv: the model's cache argument; batcher: a V4 engine's window-only HybridBatcher;
        tables: the engine's BlockTables (its sequences' rows); row_keys: batches carry
        their rows' sequence keys (the mock's draft head decides by them)."""
        self.model, self.kv, self.block_size, self.batcher, self.tables = model, kv, block_size, batcher, tables
        self.row_keys = row_keys
        self.num_spec, self.max_model_len, self.device, self.lockstep = num_spec, max_model_len, device, lockstep
        self.pending: torch.Tensor | None = None  # [drafts] the last pass's ids, on the device
        # id(sequence) -> (the sequence, its draft_ids list then, where its drafts are in pending)
        self._owners: dict[int, tuple[Sequence, list[int], list[int]]] = {}

    def propose(self, work: list[tuple[Chunk, int]], hidden: torch.Tensor) -> None:
        """work: (target chunk, number of its positions whose KV is now valid). Call after
        resolve: what an earlier pass proposed is read by then."""
        if self._owners:  # a step that read nothing (no row sampled) left them pending
            self.resolve()
        chunks, prev_rows = [], {}
        for c, n_valid in work:
            if c.seq.status == SeqStatus.FINISHED:
                continue
            chunks.append(Chunk(c.seq, c.start, c.seq.token_ids[c.start + 1 : c.start + n_valid + 1]))
            prev_rows[id(c.seq)] = range(c.row, c.row + n_valid)
        if not chunks and not self.lockstep:
            return
        batch = build_batch(chunks, self.block_size, self.device, self.batcher, tables=self.tables,
                            row_keys=self.row_keys)  # may reorder the chunks
        rows = [r for ch in chunks for r in prev_rows[id(ch.seq)]]  # one index tensor, not one per sequence
        prev = hidden[host_copy.to_device(rows, torch.long, hidden.device)] if rows else hidden[:0]
        h = self.model.mtp_forward(batch, prev, self.kv)
        want = [ch for ch in chunks if ch.seq.status in _DRAFTING and ch.seq.in_decode and self.num_spec]
        parts: list[torch.Tensor] = []
        offset = 0  # drafts proposed so far: where this pass's go in pending
        for step in range(self.num_spec):
            live = [ch for ch in want if len(ch.seq.draft_ids) == step and self.budget(ch.seq) > step]
            if not live and not self.lockstep:
                break
            last = host_copy.to_device([ch.row + ch.q_len - 1 for ch in live], torch.long, h.device)
            if live:
                drafts = self.model.mtp_logits(h[last]).argmax(dim=-1)  # stays on the device
                parts.append(drafts)
                for i, ch in enumerate(live):
                    seq = ch.seq
                    owner = self._owners.setdefault(id(seq), (seq, seq.draft_ids, []))
                    owner[2].append(offset + i)
                    seq.draft_ids.append(PLACEHOLDER)
                offset += len(live)
            if step + 1 == self.num_spec:
                break
            nxt = [Chunk(ch.seq, ch.seq.num_tokens - 1 + step, [PLACEHOLDER]) for ch in live]
            prev_h = h[last]
            batch = build_batch(nxt, self.block_size, self.device, self.batcher, tables=self.tables,
                                row_keys=self.row_keys)  # all q_len 1: order kept
            if live:
                batch.input_ids = drafts
            h = self.model.mtp_forward(batch, prev_h, self.kv)
            want = nxt
        if parts:
            self.pending = parts[0] if len(parts) == 1 else torch.cat(parts)

    def fill(self, chunks: list[Chunk], batch) -> None:
        """Writes the pending drafts that the chunks verify into the batch's input ids, on
        the device (the chunks hold PLACEHOLDER there). Call after build_batch."""
        if not self._owners:
            return
        rows, take = [], []
        for c in chunks:
            owner = self._owners.get(id(c.seq))
            if owner is None or c.seq.draft_ids is not owner[1]:
                continue
            n = c.q_len - (min(c.seq.num_tokens, c.start + c.q_len) - c.start)  # its drafts, at its end
            rows += range(c.row + c.q_len - n, c.row + c.q_len)
            take += owner[2][:n]
        if rows:
            ix = host_copy.to_device([rows, take], torch.long, self.pending.device)
            batch.input_ids[ix[0]] = self.pending[ix[1]]

    def resolve(self, values: torch.Tensor | None = None) -> None:
        """Writes the pending drafts' ids into their sequences' draft_ids. values: pending,
        read to the host already with the step's other reads; None: read it here."""
        if not self._owners:
            return
        vals = (values if values is not None else host_copy.to_host(self.pending)[0]).tolist()
        for seq, ids, where in self._owners.values():
            if seq.draft_ids is ids:  # not dropped since (a preemption, a hand-off)
                ids[:] = [vals[i] for i in where]
        self._owners, self.pending = {}, None

    def budget(self, seq: Sequence) -> int:
        """Draft tokens the sequence can still use: its output and context left after the
        token the next step samples."""
        n = len(seq.token_ids)
        return max(0, min(seq.params.max_tokens - (n - seq.num_prompt_tokens), self.max_model_len - n) - 1)
