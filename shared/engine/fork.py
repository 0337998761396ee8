"""Parallel sampling (`n` > 1): one prompt computed once, n sequences sampled from it.

Glossary (P = prompt length, bs = block size):
- parent: the sequence that computes the prompt of a request of n > 1. It computes
  positions 0 .. P-2 (all but the last), then forks into its children; it never samples.
- child: one of the n sequences. Each starts with positions 0 .. P-2 computed, computes
  position P-1 itself in its first step and samples its own first token from it. From
  the fork on a child is an ordinary sequence under its own request id.
- shared blocks: the parent's full blocks before position P-1, (P-1) // bs of them. Every
  child holds a reference on each (BlockManager.share); they return to the free list
  when the last child lets go.
- tail block: the parent's partial block that holds positions (P-1) // bs * bs .. P-2,
  when P-1 is not a multiple of bs. Child 0 takes the parent's; every other child copies
  it, before the forward of its own first step (which writes position P-1 into the
  copy): copy on first write. Until then the child holds a reference on the parent's
  tail block (`cow_src`), so that child 0 finishing first does not free it.

Why fork one position before the end, and not at the first token as vLLM's v0 block
tables did: the KV of position P-1 is the same for every child in the model's layers,
but not in the MTP layer, whose input there is the child's own first token. A child
that computes P-1 itself owns all of that position, and everything after the fork
(sampling, seeds, MTP drafts, the prefill hand-off, preemption) needs nothing of its
own. The price: n positions instead of one, and the first tokens come one step after
the prompt's last chunk rather than with it.
"""

from __future__ import annotations

from typing import Callable

import torch

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.sequence import Sequence, SeqStatus


def can_fork(prompt_len: int) -> bool:
    """A parent computes P-1 >= 1 positions; a one-token prompt's children compute it each."""
    return prompt_len >= 2


def make_children(parent: Sequence, blocks: BlockManager, last_slot: Callable[[Sequence], int]) -> list[Sequence]:
    """The parent's children, once it has computed positions 0 .. P-2. Child 0 takes the
    parent's blocks (and its references); the others share its full blocks and note its
    tail block to copy. The parent is left with no blocks."""
    bs, done = blocks.block_size, parent.num_computed
    n_shared = done // bs
    shared = parent.block_ids[:n_shared]
    tail = parent.block_ids[n_shared] if done % bs else -1
    children = []
    for i, (rid, params) in enumerate(parent.forks):
        child = Sequence(rid, list(parent.token_ids), params, num_prompt_tokens=parent.num_prompt_tokens,
                         arrival=parent.arrival)
        child.num_computed = done
        child.block_hashes = list(parent.block_hashes)
        child.num_registered = parent.num_registered
        child.num_cached_tokens = parent.num_cached_tokens
        child.fork_index = i
        child.status = SeqStatus.RUNNING
        child.last_slot = last_slot(child)
        if i == 0:
            child.block_ids = parent.block_ids
        else:
            blocks.share(shared)
            child.block_ids = list(shared)
            if tail >= 0:
                blocks.share([tail])
                child.cow_src = tail
        children.append(child)
    parent.block_ids = []
    parent.forks = []
    parent.status = SeqStatus.FINISHED
    return children


def take_copy(seq: Sequence, block_size: int) -> tuple[int, int] | None:
    """For a child about to compute its first position (its blocks allocated): the
    (source, destination) block copy that must precede that step's forward. The caller
    frees the source reference once the step has run."""
    if seq.cow_src < 0:
        return None
    pair = (seq.cow_src, seq.block_ids[seq.num_computed // block_size])
    seq.cow_src = -1
    return pair


def copy_blocks(kv: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """(source, destination) blocks, every cache layer, of the MLA cache [layers, blocks,
    bs, D]. (A DeepSeek-V4 engine does not fork: its children would need copies of the
    parent's ring as well; they compute the prompt each, see LLMEngine.add_request.)"""
    src, dst = (torch.tensor(x, dtype=torch.long, device=kv.device) for x in zip(*pairs))
    kv[:, dst] = kv[:, src]
