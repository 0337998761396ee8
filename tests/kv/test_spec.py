"""One description of a worker's KV bytes, and the one check that two of them match."""

from __future__ import annotations

import math

import pytest

from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.kv_cache import KVCache
from moemesh.shared.kv.spec import compatible, describe


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=8, **kw))


@pytest.fixture(scope="module")
def v3(tiny_model):
    return _engine(tiny_model)


@pytest.fixture(scope="module")
def v4(tiny_v4_model):
    return _engine(tiny_v4_model)


@pytest.mark.parametrize("which", ["v3", "v4"])
def test_sizes_are_those_of_the_engines_export(which, request):
    e = request.getfixturevalue(which)
    spec = describe(e)
    for n in (0, 1, 3, 7):
        assert spec.shape(n) == e.kv_shape(n)
        assert spec.nbytes(n) == math.prod(e.kv_shape(n)) * e.kv_dtype.itemsize
        # three children of one prompt moving together (engine/fork_io.py): V4 carries three windows
        assert spec.shape(n, 3) == e.kv_shape(n, 3)
        assert spec.nbytes(n, 3) == math.prod(e.kv_shape(n, 3)) * e.kv_dtype.itemsize
    assert spec.nbytes(5) - spec.nbytes(4) == spec.bytes_per_block


def test_mla_block_bytes_match_the_cache_and_its_block_major_buffers(v3):
    spec = describe(v3)
    c = v3.model_config
    assert spec.bytes_per_block == KVCache.bytes_per_block(c, v3.cfg.block_size, v3.kv_dtype)
    assert spec.carry_numel == 0 and spec.nbytes(3) == spec.blocks_nbytes(3)
    assert spec.block_shape(3) == (3, c.num_cache_layers, v3.cfg.block_size, c.kv_cache_dim)
    assert spec.why_not_blocks(3, spec.blocks_nbytes(3)) == ""
    assert "size mismatch" in spec.why_not_blocks(3, spec.blocks_nbytes(2))


def test_v4_blocks_are_the_main_rows_and_the_ring_window_travels_once(v4):
    spec = describe(v4)
    lay = v4.kv.layout
    assert spec.hybrid and spec.bytes_per_block == lay.main_width * v4.kv_dtype.itemsize
    assert spec.carry_numel == lay.carry_width > 0
    # A V4 move is a prefix's blocks and the boundary snapshot after them, in one flat buffer.
    assert spec.block_shape(3) == spec.shape(3) == (3 * lay.main_width + lay.carry_width,)
    assert spec.why_not_blocks(3, spec.blocks_nbytes(3)) == ""
    assert "size mismatch" in spec.why_not_blocks(1, spec.bytes_per_block)


def test_compatible_names_what_differs(tiny_model, tiny_v2_model, v3):
    spec = describe(v3)
    assert compatible(spec, describe(_engine(tiny_model, role="decode")))
    assert compatible(spec, spec.wire) and compatible(spec.wire, spec)  # either side may be the wire form
    c = compatible(spec, describe(_engine(tiny_model, block_size=32)))
    assert not c and "block size" in c.reason and "16" in c.reason and "32" in c.reason
    c = compatible(spec, describe(_engine(tiny_model, dtype="bfloat16")))
    assert not c and c.reason.startswith("dtype")
    c = compatible(spec, describe(_engine(tiny_v2_model)))
    assert not c and c.reason.startswith("model") and "deepseek_v2" in c.reason


def test_v4_against_v3_is_refused(v3, v4):
    c = compatible(describe(v4), describe(v3))
    assert not c and "deepseek_v4" in c.reason and "deepseek_v3" in c.reason


def test_v4_against_v4_of_another_architecture_is_refused_though_buffers_match(v4, tiny_v4_model, tmp_path):
    from moemesh.shared.checkpoint.writer import init_model

    spec = describe(v4)
    assert compatible(spec, describe(_engine(tiny_v4_model, role="decode")))
    types = list(v4.model_config.layer_types)
    types[1], types[2] = types[2], types[1]
    other = describe(_engine(str(init_model(tmp_path / "m", "v4-tiny", overrides={"layer_types": types}))))
    assert other.nbytes(3) == spec.nbytes(3) and other.shape(3) == spec.shape(3)
    c = compatible(spec, other)
    assert not c and c.reason.startswith("model")
