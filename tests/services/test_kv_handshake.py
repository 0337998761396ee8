"""The KV layout a decode worker checks before it takes a prefill worker's KV, and the
refusal to move DeepSeek-V4 blocks one by one."""

from __future__ import annotations


from moemesh.shared.engine import block_io
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.kv.spec import describe
from moemesh.shared.protocol.messages import KVLayout


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=8, **kw))


def kv_layout(engine: LLMEngine) -> KVLayout:
    return describe(engine).wire


def test_v2_v3_layout_is_the_paged_cache_geometry(tiny_model, tiny_v2_model):
    e = _engine(tiny_model)
    c = e.model_config
    # Workers of an older build compare against exactly this.
    assert kv_layout(e) == KVLayout(c.num_cache_layers, 16, c.kv_cache_dim, "float32",
                                    f"deepseek_v3:{c.hidden_size}x{c.num_hidden_layers}:{c.vocab_size}:{c.kv_lora_rank}")
    assert kv_layout(_engine(tiny_model, role="decode")) == kv_layout(_engine(tiny_model, role="prefill"))
    assert kv_layout(_engine(tiny_model, block_size=32)) != kv_layout(e)
    assert kv_layout(_engine(tiny_model, dtype="bfloat16")) != kv_layout(e)
    assert kv_layout(_engine(tiny_v2_model)) != kv_layout(e)


def test_v4_layout_names_the_flat_buffer_and_the_architecture(tiny_v4_model, tmp_path):
    from moemesh.shared.checkpoint.writer import init_model

    pre, dec = _engine(tiny_v4_model, role="prefill"), _engine(tiny_v4_model, role="decode")
    lay = kv_layout(pre)
    assert lay == kv_layout(dec)
    assert (lay.block_size, lay.dim, lay.dtype) == (pre.cfg.block_size, pre.kv_shape(1)[0], "float32")
    assert kv_layout(_engine(tiny_v4_model, dtype="bfloat16")) != lay
    # The same layer types in another order: buffers of the same length, rows filed elsewhere.
    types = list(pre.model_config.layer_types)
    types[1], types[2] = types[2], types[1]
    other = _engine(str(init_model(tmp_path / "m", "v4-tiny", overrides={"layer_types": types})))
    assert other.kv_shape(3) == pre.kv_shape(3)
    assert kv_layout(other) != lay


def test_v4_blocks_move_with_their_snapshot(tiny_v4_model):
    e = _engine(tiny_v4_model)
    describe(e)
    assert block_io.acquire_exact(e, [b"h"]) is None and block_io.depth(e, [b"h"]) == 0  # no such block, let alone its snapshot
