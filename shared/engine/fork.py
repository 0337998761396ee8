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
- ring (DeepSeek-V4 only): a sequence's store of its recent positions (window keys,
  the compressors' projections of groups not yet complete), which every step writes.
  Child 0 takes the parent's; every other child gets a whole copy of it, made right
  after the forward of the parent's last chunk (`ring_copies`), into a ring the parent
  has held for it since its admission (`Sequence.fork_rings`). A V4 block's main row
  (compressed entries, index keys) goes with the block: a shared full block holds only
  complete groups, which no child writes again; the tail block's row gains the groups a
  child completes, so it is copied on first write as above.

Why fork one position before the end, and not at the first token as vLLM's v0 block
tables did: the KV of position P-1 is the same for every child in the model's layers,
but not in the MTP layer, whose input there is the child's own first token. A child
that computes P-1 itself owns all of that position, and everything after the fork
(sampling, seeds, MTP drafts, the prefill hand-off, preemption) needs nothing of its
own. The price: n positions instead of one, and the first tokens come one step after
the prompt's last chunk rather than with it.

Why a V4 child's ring is copied after the parent's last forward, and not before the
child's first like the tail block: the source would then be child 0's ring, and child 0
may be aborted or preempted in between and its ring handed to another sequence. Right
after the parent's forward every child's ring is already its own, and the parent's
state is complete in it.
"""

from __future__ import annotations

from typing import Callable

import torch

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.host_copy import to_device
from moemesh.shared.engine.sequence import Sequence, SeqStatus


def can_fork(prompt_len: int) -> bool:
    """A parent computes P-1 >= 1 positions; a one-token prompt's children compute it each."""
    return prompt_len >= 2


def make_children(parent: Sequence, blocks: BlockManager, last_slot: Callable[[Sequence], int]) -> list[Sequence]:
    """The parent's children, once it has computed positions 0 .. P-2. Child 0 takes the
    parent's blocks (and its references) and its ring; the others share its full blocks,
    note its tail block to copy, and take the rings it held for them. The parent is left
    with no blocks and no ring."""
    bs, done = blocks.block_size, parent.num_computed
    n_shared = done // bs
    shared = parent.block_ids[:n_shared]
    tail = parent.block_ids[n_shared] if done % bs else -1
    rings = [parent.ring, *parent.fork_rings] if parent.ring >= 0 else []
    children = []
    for i, (rid, params) in enumerate(parent.forks):
        child = Sequence(rid, list(parent.token_ids), params, num_prompt_tokens=parent.num_prompt_tokens,
                         arrival=parent.arrival)
        child.num_computed = done
        child.block_hashes = list(parent.block_hashes)
        child.num_registered = parent.num_registered
        child.num_cached_tokens = parent.num_cached_tokens
        child.prompt_logprobs = parent.prompt_logprobs  # the parent computes every position it scores
        child.fork_index = i
        child.status = SeqStatus.RUNNING
        child.last_slot = last_slot(child)
        if rings:
            child.ring = rings[i]
        if i == 0:
            child.block_ids = parent.block_ids
        else:
            blocks.share(shared)
            child.block_ids = list(shared)
            if tail >= 0:
                blocks.share([tail])
                child.cow_src = tail
        children.append(child)
    for r in rings[len(children):]:  # held for children aborted before the fork
        blocks.give_ring(r)
    parent.block_ids = []
    parent.ring, parent.fork_rings = -1, []
    parent.forks = []
    parent.status = SeqStatus.FINISHED
    return children


def ring_copies(children: list[Sequence]) -> list[tuple[int, int]]:
    """V4: the (source, destination) ring copies that give children 1.. the parent's
    state (child 0 holds the parent's ring). They must follow the forward that computes
    the parent's last chunk, and precede any other forward."""
    src = children[0].ring
    return [(src, c.ring) for c in children[1:]] if src >= 0 else []


def take_copy(seq: Sequence, block_size: int) -> tuple[int, int] | None:
    """For a child about to compute its first position (its blocks allocated): the
    (source, destination) block copy that must precede that step's forward. The caller
    frees the source reference once the step has run."""
    if seq.cow_src < 0:
        return None
    pair = (seq.cow_src, seq.block_ids[seq.num_computed // block_size])
    seq.cow_src = -1
    return pair


def copy_blocks(kv, pairs: list[tuple[int, int]]) -> None:
    """(source, destination) blocks, every cache layer, of the MLA cache [layers, blocks,
    bs, D]; of a V4 cache (HybridKVCache), their main rows."""
    if not isinstance(kv, torch.Tensor):
        kv.copy_blocks(pairs)
        return
    src, dst = (to_device(x, torch.long, kv.device) for x in zip(*pairs))
    kv[:, dst] = kv[:, src]
