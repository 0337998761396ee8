"""The prefill -> decode hand-off of a parent's children (engine/fork.py) as one buffer:
the prompt's KV moves once for all of them.

Held children share their prompt's full blocks before position P-1 (P = prompt length)
and differ in the block holding P-1 onward: each computed that position itself (its
MTP-layer KV there depends on its own first token). Their hand-off buffer is the
hand-off layout (KVSpec.shape) of num_blocks(P, m) blocks: the shared blocks, once,
then the last block of each child in order. The decode side files the shared blocks
once, with a reference per child, and each last block into a block of that child's.

On DeepSeek-V4 a block is its main row, and each child also carries the look-back of
its own ring before its next position (hybrid_cache.py): per-sequence state, which
differs between children from P-1 on (the MTP layer's window). The buffer is then the
num_blocks(P, m) main rows, then the m carries in the same order (KVSpec.shape(...,
num_carries=m)); each child's carry is filed into a ring of its own.
"""

from __future__ import annotations

import torch

from moemesh.shared.engine.engine import LLMEngine, NoCapacity, RequestError
from moemesh.shared.protocol.messages import SamplingParams


def num_shared(num_prompt_tokens: int, block_size: int) -> int:
    return (num_prompt_tokens - 1) // block_size


def num_blocks(num_prompt_tokens: int, num_children: int, block_size: int) -> int:
    return num_shared(num_prompt_tokens, block_size) + num_children


def shape(engine: LLMEngine, num_prompt_tokens: int, num_children: int) -> tuple[int, ...]:
    """Shape of the buffer that moves num_children children of a prompt."""
    return engine.kv_shape(num_blocks(num_prompt_tokens, num_children, engine.cfg.block_size), num_children)


def export(engine: LLMEngine, request_ids: list[str], out: torch.Tensor | None = None) -> torch.Tensor:
    """Held children of one prompt, in the order given, as one hand-off buffer."""
    seqs = [engine.held_sequence(r) for r in request_ids]
    p = seqs[0].num_prompt_tokens
    if any(s.num_prompt_tokens != p or s.token_ids[:p] != seqs[0].token_ids[:p] for s in seqs):
        raise ValueError("children of different prompts do not move together")
    s = num_shared(p, engine.cfg.block_size)
    blocks = seqs[0].block_ids[:s] + [q.block_ids[s] for q in seqs]
    if not engine.hybrid:
        return engine.kv.export_blocks(blocks, out)
    kv = engine.kv
    if out is None:
        out = torch.empty(shape(engine, p, len(seqs)), dtype=kv.dtype, device=kv.main.device)
    mains, carries = _split(engine, out, len(blocks), len(seqs))
    kv.export_main(blocks, mains)
    for q, carry in zip(seqs, carries):
        kv.export_carry(q.ring, q.num_computed, carry)
    return out


def can_import(engine: LLMEngine, num_prompt_tokens: int, num_children: int) -> bool:
    if engine.blocks.uses_rings and engine.blocks.num_free_rings < num_children:
        return False
    return engine.blocks.can_allocate(num_blocks(num_prompt_tokens, num_children, engine.cfg.block_size))


def add(engine: LLMEngine, children: list[tuple[str, list[int], SamplingParams, list[int]]],
        num_prompt_tokens: int, kv: torch.Tensor, skip: set[str] = frozenset()) -> None:
    """Continue children whose prompt KV came as one buffer (`export`): (request id,
    prompt plus the tokens sampled there, params, MTP drafts) each, in buffer order.
    skip: children in the buffer that are not to run (aborted on the way)."""
    bs = engine.cfg.block_size
    m, s = len(children), num_shared(num_prompt_tokens, bs)
    want = shape(engine, num_prompt_tokens, m)
    if tuple(kv.shape) != want:
        raise RequestError(f"KV buffer has shape {tuple(kv.shape)}, {want} expected for {m} children")
    live = [c for c in children if c[0] not in skip]
    for rid, toks, params, drafts in live:
        engine.admission.check_prefilled(rid, toks, num_prompt_tokens, params, drafts)
        if toks[:num_prompt_tokens] != live[0][1][:num_prompt_tokens]:
            raise RequestError("children moved together must share their prompt")
    if len({c[0] for c in live}) < len(live):
        raise RequestError("duplicate request ids among the children")
    if not live:
        return
    if not can_import(engine, num_prompt_tokens, len(live)):
        what = f"{s + len(live)} KV blocks" + (f" and {len(live)} rings" if engine.blocks.uses_rings else "")
        raise NoCapacity(f"{what} needed, {engine.blocks.num_free_blocks} blocks free")
    shared = engine.blocks.allocate(s)
    tails = engine.blocks.allocate(len(live))
    rings = [engine.blocks.take_ring() for _ in live] if engine.hybrid else [-1] * len(live)
    kept = [i for i, c in enumerate(children) if c[0] not in skip]
    try:
        _import(engine, kv, shared + tails, s, m, kept, rings, num_prompt_tokens)
    except Exception:
        _give_back(engine, shared + tails, rings)
        raise
    for i, ((rid, toks, params, drafts), tail, ring) in enumerate(zip(live, tails, rings)):
        if i:
            engine.blocks.share(shared)
        try:
            engine.admission.run_prefilled(rid, toks, num_prompt_tokens, params, list(shared) + [tail], ring, drafts)
        except RequestError:  # its references went back with it; the children after it hold none on `shared`
            _give_back(engine, tails[i + 1 :], rings[i + 1 :])
            # All or none: the caller fails every child, so the ones started must not run on unseen.
            for started, *_ in live[:i]:
                engine.abort(started)
            raise


def _import(engine: LLMEngine, kv: torch.Tensor, blocks: list[int], s: int, m: int, kept: list[int],
            rings: list[int], num_prompt_tokens: int) -> None:
    """File the buffer's shared blocks and the kept children's (`kept`: their places in
    it) into `blocks`, and on V4 each kept child's carry into its ring."""
    rows = list(range(s)) + [s + i for i in kept]
    if not engine.hybrid:
        engine.kv.import_blocks(blocks, kv if len(rows) == s + m else kv[:, rows])
        return
    mains, carries = _split(engine, kv, s + m, m)
    engine.kv.import_main(blocks, mains if len(rows) == s + m else mains.view(s + m, -1)[rows].flatten())
    for i, ring in zip(kept, rings):
        engine.kv.import_carry(ring, num_prompt_tokens, carries[i])


def _split(engine: LLMEngine, buf: torch.Tensor, n_blocks: int, n_carries: int) -> tuple[torch.Tensor, list]:
    """A V4 buffer's main rows (flat) and its carries, as views."""
    lay = engine.kv.layout
    mw = n_blocks * lay.main_width
    return buf[:mw], list(buf[mw:].view(n_carries, lay.carry_width))


def _give_back(engine: LLMEngine, blocks: list[int], rings: list[int]) -> None:
    engine.blocks.free(blocks)
    for r in rings:
        if r >= 0:
            engine.blocks.give_ring(r)
