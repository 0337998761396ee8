"""DeepSeek-V4 engine mechanics: block size, rings, empty lockstep batches, bad buffers."""

from __future__ import annotations

import pytest
import torch

from moemesh.shared.engine.block_manager import BlockManager
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine, RequestError
from moemesh.shared.engine.runner import build_batch
from moemesh.shared.protocol.messages import SamplingParams


def _engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 32)
    return LLMEngine(EngineConfig(model=model_dir, **kw))


def test_block_size_holds_whole_groups(tiny_v4_model):
    eng = _engine(tiny_v4_model, block_size=4)  # groups of 16 (HCA) do not fit: raised to 16
    assert eng.cfg.block_size == 16 and eng.cfg.enable_prefix_caching
    assert not _engine(tiny_v4_model, num_prefix_snapshots=0).blocks.enable_caching  # no usable prefix without them
    assert eng.blocks.uses_rings and eng.blocks.num_rings == 2 * eng.cfg.max_num_seqs


def test_an_empty_batch_runs_as_lockstep_ranks_need(tiny_v4_model):
    eng = _engine(tiny_v4_model)
    h = eng.model(build_batch([], eng.cfg.block_size, "cpu", eng.batcher), eng.kv.forward_arg)
    assert h.shape == (0, eng.model_config.hc_mult * eng.model_config.hidden_size)
    assert eng.model.compute_logits(h).shape == (0, eng.model_config.vocab_size)
    d = eng.model.mtp_forward(build_batch([], eng.cfg.block_size, "cpu", eng.draft_batcher), h, eng.kv.forward_arg)
    assert eng.model.mtp_logits(d).shape == (0, eng.model_config.vocab_size)


def test_a_sequence_holds_one_ring_while_it_has_blocks(tiny_v4_model):
    eng = _engine(tiny_v4_model, max_num_seqs=2)
    free = eng.blocks.num_free_rings
    for i in range(3):
        eng.add_request(f"r{i}", [0, 5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.step()
    assert eng.blocks.num_free_rings == free - 2  # two running (max_num_seqs), one waiting without a ring
    assert sorted(s.ring for s in eng.scheduler.running) == [0, 1]
    while eng.has_unfinished():
        eng.step()
    assert eng.blocks.num_free_rings == free and eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_rings_freed_during_a_step_wait_for_it():
    bm = BlockManager(8, 16, num_rings=2)
    a, b = bm.take_ring(), bm.take_ring()
    assert (a, b) == (0, 1) and bm.num_free_rings == 0
    bm.begin_step(7)
    bm.give_ring(a)
    assert bm.num_free_rings == 0  # step 7 may still write it
    bm.end_step(7)
    assert bm.num_free_rings == 1
    with pytest.raises(MemoryError):
        bm.take_ring(), bm.take_ring()
    bm.check()


def test_a_prefilled_buffer_of_the_wrong_size_is_refused_and_nothing_leaks(tiny_v4_model):
    eng = _engine(tiny_v4_model, role="decode")
    n = eng.blocks.blocks_for(5)
    good = torch.zeros(eng.kv_shape(n), dtype=eng.kv_dtype)
    with pytest.raises(RequestError, match="shape"):
        eng.add_prefilled("r", [0, 1, 2, 3, 4, 9], 5, SamplingParams(max_tokens=2), good[:-1])
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert eng.blocks.num_free_rings == eng.blocks.num_rings
    eng.add_prefilled("r", [0, 1, 2, 3, 4, 9], 5, SamplingParams(max_tokens=2), good)
    assert eng.blocks.num_free_rings == eng.blocks.num_rings - 1


def test_fused_linears_load_through_their_views_and_compute_what_each_would():
    from torch import nn

    from moemesh.shared.model.layers import FusedLinears

    torch.manual_seed(0)
    a, b = nn.Linear(8, 3, bias=False), nn.Linear(8, 5, bias=False)
    fused = FusedLinears(a, b)
    with torch.no_grad():  # what the loader does: copy into each linear's weight
        b.weight.copy_(torch.randn(5, 8))
    x = torch.randn(4, 8)
    y = fused(x)
    torch.testing.assert_close(y[:, :3], a(x))
    torch.testing.assert_close(y[:, 3:], b(x))
    assert fused.intact
    b.weight = nn.Parameter(b.weight.detach().clone())  # replaced: no longer the fused rows
    assert not fused.intact


def test_the_fused_projections_generate_what_the_linears_one_by_one_do(tiny_v4_model):
    """A loaded V4 model projects each layer's input in one GEMM (V4Attention.fuse); with
    the fusion dropped, each linear runs on its own: the same tokens, through prefill
    chunks, decode rows and groups the compressors pool. (The kernel path runs fused in
    tests/kernels/test_engine_with_kernels.py.)"""
    from moemesh.shared.checkpoint.loader import load_model

    prompts = [[0] + [5 + (i * 7 + j) % 50 for j in range(n)] for i, n in enumerate((3, 20, 37))]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for fused in (True, False):
        model = load_model(tiny_v4_model)
        attns = [m for m in model.modules() if hasattr(m, "x_proj")]
        assert attns and all(m.x_proj is not None and m.x_proj.intact for m in attns)
        if not fused:
            for m in attns:
                m.x_proj = None
        eng = LLMEngine(EngineConfig(model=tiny_v4_model, num_kv_blocks=32, num_speculative_tokens=0), model=model)
        for i, ids in enumerate(prompts):
            eng.add_request(f"r{i}", ids, p)
        got: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs.append(got)
    assert outs[0] == outs[1] and sorted(outs[0]) == ["r0", "r1", "r2"] and all(len(v) == 6 for v in outs[0].values())
