"""The static decode path (decode_graphs.py), run eagerly on a CPU: the same buffers,
buckets and padding a CUDA graph replays, against the dynamic path it replaces."""

import pytest
import torch

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.decode_graphs import DecodeGraphs, buckets
from moemesh.shared.engine.load_tracker import LoadTracker
from moemesh.shared.engine.runner import Chunk, _get, build_batch, index_tensors
from moemesh.shared.protocol.messages import SamplingParams
from tests.engine.step_drivers import run_overlapped


def _requests(eng) -> None:
    # Lengths that end at different steps, so the batch shrinks through 7, 5, 3 and 1
    # rows and rows that were real are padding again. Two rows sample with a seed.
    for i in range(7):
        params = SamplingParams(max_tokens=3 + 4 * (i % 4), temperature=0.8 if i % 3 == 0 else 0.0,
                                seed=11 + i if i % 3 == 0 else None, ignore_eos=True)
        eng.add_request(f"r{i}", [(17 * i + j) % 200 + 1 for j in range(5 + 3 * i)], params)


def _engine(factory, mode):
    return factory(num_speculative_tokens=0, max_model_len=256, max_num_seqs=24, decode_graphs=mode)


def _counted(monkeypatch) -> list[int]:
    sizes: list[int] = []
    forward = DecodeGraphs._forward

    def spy(self, size):
        sizes.append(size)
        return forward(self, size)

    monkeypatch.setattr(DecodeGraphs, "_forward", spy)
    return sizes


def test_static_path_equals_dynamic(tiny_engine_factory, monkeypatch):
    sizes = _counted(monkeypatch)
    outs, kv, loads = {}, {}, {}
    for mode in ("off", "eager"):
        eng = _engine(tiny_engine_factory, mode)
        tracker = LoadTracker(eng.model, window_steps=1000)
        try:
            _requests(eng)
            outs[mode] = run_overlapped(eng, {})
            tracker.end_step()
            kv[mode], loads[mode] = eng.kv.tensor.clone(), tracker.window()
        finally:
            for m in eng.model.moe_layers().values():
                m.on_route = None
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert outs["eager"] == outs["off"]
    assert len(outs["off"]) == 7
    # Every decode step took the static path, at buckets 8, 4, 2 and 1 as the batch shrank.
    assert sizes and set(sizes) <= {1, 2, 4, 8} and {8, 1} <= set(sizes)
    # The caches agree on every block a sequence owns; padding wrote the scratch block only.
    n = kv["off"].shape[1] - 1
    torch.testing.assert_close(kv["eager"][:, :n], kv["off"][:, :n], rtol=1e-5, atol=1e-5)
    assert not kv["off"][:, n].any() and kv["eager"][:, n].any()
    # The load tracker counts the real rows, not the padding.
    assert torch.equal(loads["eager"], loads["off"]) and loads["off"].sum() > 0


@pytest.mark.parametrize("arch", ["v3", "v4"])
def test_a_bucket_has_one_set_of_shapes_whatever_its_rows(tiny_engine_factory, tiny_v4_engine_factory, arch):
    """What a graph needs: every batch padded to a bucket has its template's shapes, at
    any number of real rows and any positions (V4: rows that complete a group or not)."""
    factory = tiny_engine_factory if arch == "v3" else tiny_v4_engine_factory
    eng = _engine(factory, "eager")
    for i in range(5):
        eng.add_request(f"s{i}", [3 + i] * (3 + 5 * i), SamplingParams(max_tokens=8, temperature=0.0))
    while any(not s.num_output_tokens for s in eng.seqs.values()):
        eng.step()  # the prompts
    seqs = list(eng.seqs.values())
    g = eng.graphs
    for k in (1, 3, 5):
        chunks = [Chunk(s, s.num_computed, [s.token_ids[s.num_computed]]) for s in seqs[:k]]
        pad = g.padding(chunks)
        batch = build_batch(chunks, eng.cfg.block_size, hybrid=eng.batcher, pad=pad)
        template = g._template(pad.rows)
        assert batch.static and batch.num_decode == k and batch.num_tokens == pad.rows == (8 if k > 4 else 4 if k > 2 else 1)
        got = [tuple(_get(*x).shape) for x in index_tensors(batch)]
        assert got == [tuple(_get(*x).shape) for x in index_tensors(template)]
    for s in seqs:
        eng.abort(s.request_id)


def test_batches_it_does_not_take_run_dynamically(tiny_engine_factory, monkeypatch):
    sizes = _counted(monkeypatch)
    eng = _engine(tiny_engine_factory, "eager")
    eng.add_request("p", list(range(1, 40)), SamplingParams(max_tokens=2, temperature=0.0))
    eng.step()  # a prompt chunk: dynamic
    assert sizes == []
    eng.step()  # one decode row: bucket 1
    assert sizes == [1]
    assert not eng.has_unfinished()


def test_buckets_and_modes(tiny_engine_factory):
    assert buckets(1) == (1,)
    assert buckets(8) == (1, 2, 4, 8)
    assert buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    assert buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert _engine(tiny_engine_factory, "auto").graphs is None  # a CPU: no capture, no static path
    assert _engine(tiny_engine_factory, "off").graphs is None
    assert _engine(tiny_engine_factory, "eager").graphs.buckets == (1, 2, 4, 8, 16, 24)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EngineConfig(model="m", decode_graphs="on")
    with pytest.raises(ValueError, match="decode_graphs must be one of"):
        EngineConfig(model="m", decode_graphs="always")


def test_v4_static_path_equals_dynamic(tiny_v4_engine_factory, monkeypatch):
    sizes = _counted(monkeypatch)
    outs, main, rings = {}, {}, {}
    for mode in ("off", "eager"):
        eng = _engine(tiny_v4_engine_factory, mode)
        _requests(eng)
        outs[mode] = run_overlapped(eng, {})
        main[mode], rings[mode] = eng.kv.main.clone(), eng.kv.rings.clone()
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert outs["eager"] == outs["off"] and len(outs["off"]) == 7
    assert sizes and set(sizes) <= {1, 2, 4, 8} and {8, 1} <= set(sizes)
    # Blocks and rings that sequences own agree; padding wrote the scratch block and ring only.
    nb, nr = eng.kv.scratch_block, eng.kv.scratch_ring
    torch.testing.assert_close(main["eager"][:nb], main["off"][:nb], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rings["eager"][:nr], rings["off"][:nr], rtol=1e-5, atol=1e-5)
    assert not rings["off"][nr].any() and rings["eager"][nr].any()
