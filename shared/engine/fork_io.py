"""The prefill -> decode hand-off of a parent's children (engine/fork.py) as one buffer:
the prompt's KV moves once for all of them.

Held children share their prompt's full blocks before position P-1 (P = prompt length)
and differ in the block holding P-1 onward: each computed that position itself (its
MTP-layer KV there depends on its own first token). Their hand-off buffer is the MLA
hand-off layout (KVSpec.shape) of num_blocks(P, m) blocks: the shared blocks, once,
then the last block of each child in order. The decode side files the shared blocks
once, with a reference per child, and each last block into a block of that child's.

A DeepSeek-V4 engine does not fork, so its children move one by one (`together`).
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.engine import LLMEngine, NoCapacity, RequestError
from moemesh.shared.protocol.sampling import SamplingParams


def together(engine: LLMEngine) -> bool:
    """Whether this engine's children can move as one buffer."""
    return not engine.hybrid


def num_shared(num_prompt_tokens: int, block_size: int) -> int:
    return (num_prompt_tokens - 1) // block_size


def num_blocks(num_prompt_tokens: int, num_children: int, block_size: int) -> int:
    return num_shared(num_prompt_tokens, block_size) + num_children


def export(engine: LLMEngine, request_ids: list[str], out: torch.Tensor | None = None) -> torch.Tensor:
    """Held children of one prompt, in the order given, as one hand-off buffer."""
    seqs = [engine.held_sequence(r) for r in request_ids]
    p = seqs[0].num_prompt_tokens
    if any(s.num_prompt_tokens != p or s.token_ids[:p] != seqs[0].token_ids[:p] for s in seqs):
        raise ValueError("children of different prompts do not move together")
    s = num_shared(p, engine.cfg.block_size)
    return engine.kv.export_blocks(seqs[0].block_ids[:s] + [q.block_ids[s] for q in seqs], out)


def can_import(engine: LLMEngine, num_prompt_tokens: int, num_children: int) -> bool:
    return engine.blocks.can_allocate(num_blocks(num_prompt_tokens, num_children, engine.cfg.block_size))


def add(engine: LLMEngine, children: list[tuple[str, list[int], SamplingParams, list[int]]],
        num_prompt_tokens: int, kv: torch.Tensor, skip: set[str] = frozenset()) -> None:
    """Continue children whose prompt KV came as one buffer (`export`): (request id,
    prompt plus the tokens sampled there, params, MTP drafts) each, in buffer order.
    skip: children in the buffer that are not to run (aborted on the way)."""
    if not together(engine):
        raise RequestError("this engine's children move one by one")
    bs = engine.cfg.block_size
    m, s = len(children), num_shared(num_prompt_tokens, bs)
    want = engine.kv_shape(s + m)
    if tuple(kv.shape) != want:
        raise RequestError(f"KV buffer has shape {tuple(kv.shape)}, {want} expected for {m} children")
    live = [c for c in children if c[0] not in skip]
    for rid, toks, params, drafts in live:
        engine.check_prefilled(rid, toks, num_prompt_tokens, params, drafts)
        if toks[:num_prompt_tokens] != live[0][1][:num_prompt_tokens]:
            raise RequestError("children moved together must share their prompt")
    if len({c[0] for c in live}) < len(live):
        raise RequestError("duplicate request ids among the children")
    if not live:
        return
    if not engine.blocks.can_allocate(s + len(live)):
        raise NoCapacity(f"{s + len(live)} KV blocks needed, {engine.blocks.num_free_blocks} free")
    shared = engine.blocks.allocate(s)
    tails = engine.blocks.allocate(len(live))
    rows = list(range(s)) + [s + i for i, c in enumerate(children) if c[0] not in skip]
    try:
        engine.kv.import_blocks(shared + tails, kv if len(rows) == s + m else kv[:, rows])
    except Exception:
        engine.blocks.free(shared + tails)
        raise
    for i, ((rid, toks, params, drafts), tail) in enumerate(zip(live, tails)):
        if i:
            engine.blocks.share(shared)
        engine.run_prefilled(rid, toks, num_prompt_tokens, params, list(shared) + [tail], draft_ids=drafts)
