import numpy as np
import pytest

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.plan.dims import from_config


def test_v3_dims_match_its_published_shape():
    d = from_config(preset_config("v3"), "v3")
    assert (d.family, d.num_layers, d.num_moe_layers, d.num_experts, d.top_k) == ("mla", 61, 58, 256, 8)
    assert d.expert_params == 3 * 7168 * 2048
    # The MLA cache is 576 bf16 values per token and layer: 71,424 B over 62 layers with MTP
    # (docs/benchmarks.md), 61 target layers here.
    assert d.kv_stored_bytes(1) == 61 * 576 * 2
    # Dense part: ~187M attention parameters a layer, and it must dwarf no expert count.
    assert 10e9 < d.dense_params < 20e9
    flops, nbytes = d.decode_attn(np.array([1000.0, 2000.0]))
    assert flops[1] == pytest.approx(2 * flops[0]) and nbytes[1] == pytest.approx(2 * nbytes[0])


def test_v4_flash_reads_its_compressed_layers():
    d = from_config(preset_config("v4-flash"), "v4-flash")
    assert (d.family, d.num_layers, d.num_experts, d.top_k) == ("v4", 43, 256, 6)
    assert (d.csa_rate, d.hca_rate, d.num_csa_layers, d.num_hca_layers) == (4, 128, 21, 20)
    assert d.expert_weight_bytes == 0.5  # released in FP4
    v3 = from_config(preset_config("v3"), "v3")
    # At 32k of context a V4-Flash query reads a small fraction of what a V3 one reads.
    assert d.decode_attn(32768.0)[1] < 0.2 * v3.decode_attn(32768.0)[1]
    # The window caps short contexts: attention grows slower than context.
    a, b = d.decode_attn(1000.0)[0], d.decode_attn(64000.0)[0]
    assert b < 64 * a
    # Prefill cost rises with the cached prefix.
    assert d.prefill_attn_flops(1000, 30000) > d.prefill_attn_flops(1000, 0)


def test_v4_tiny_hf_spelling_gives_the_same_kinds():
    d = from_config(preset_config("v4-tiny"), "v4-tiny")
    assert (d.csa_rate, d.hca_rate, d.num_csa_layers, d.num_hca_layers) == (4, 16, 2, 1)


def test_unsupported_config_is_a_clean_error():
    with pytest.raises(ValueError, match="model_type"):
        from_config({"model_type": "llama", "hidden_size": 1, "vocab_size": 1, "num_hidden_layers": 1,
                     "n_routed_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 1})
