import math

import pytest
import torch
from safetensors.torch import save_file

from moemesh.shared.checkpoint.quant import (
    QuantSpec, dequant_fp4, dequant_fp8_block, e8m0_to_float, quantize_fp4, quantize_fp8_block,
)
from moemesh.shared.checkpoint.safetensors_io import SafetensorsFile

E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
V4_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _e8m0(codes):
    return torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# --- decoding the formats -------------------------------------------------------------

def test_e8m0_known_values():
    got = e8m0_to_float(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8))
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(got[6])


def test_e8m0_matches_torch_for_every_code():
    raw = torch.arange(256, dtype=torch.uint8)
    ours = e8m0_to_float(raw)
    for other in (e8m0_to_float(raw.view(torch.float8_e8m0fnu)), raw.view(torch.float8_e8m0fnu).float()):
        torch.testing.assert_close(ours, other, rtol=0, atol=0, equal_nan=True)
    assert ours.isnan().nonzero().flatten().tolist() == [255]


def test_e2m1_all_codes_low_nibble_first():
    # byte k holds code k in its low nibble and code 15-k in its high nibble
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | ((15 - codes) << 4)).view(1, 16)
    got = dequant_fp4(packed, _e8m0([[127]]), torch.float32)[0]
    assert got[0::2].tolist() == E2M1
    assert got[1::2].tolist() == E2M1[::-1]
    assert got[16].item() == 0 and math.copysign(1, got[16].item()) == -1  # code 8 is -0


def test_fp4_scale_and_dtype_views():
    packed = torch.tensor([[0x21] * 16, [0xF7] * 16], dtype=torch.uint8)  # [0.5, 1] and [6, -6]
    scale = _e8m0([[128], [125]])  # 2 and 1/4
    want = torch.tensor([[1.0, 2.0] * 16, [1.5, -1.5] * 16])
    assert torch.equal(dequant_fp4(packed, scale, torch.float32), want)
    assert torch.equal(dequant_fp4(packed.view(torch.int8), scale.view(torch.uint8), torch.float32), want)
    assert torch.equal(dequant_fp4(packed.view(torch.float4_e2m1fn_x2), scale, torch.float32), want)
    assert dequant_fp4(packed, scale).dtype == torch.bfloat16


def test_fp8_block_dequant_maps_each_element_to_its_block():
    out, inp, (bo, bi) = 130, 70, (64, 32)
    q = (torch.randn(out, inp) * 50).to(torch.float8_e4m3fn)
    codes = torch.randint(120, 135, (3, 3), dtype=torch.uint8)
    full = e8m0_to_float(codes).repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    want = q.float() * full
    assert torch.equal(dequant_fp8_block(q, codes.view(torch.float8_e8m0fnu), (bo, bi), torch.float32), want)
    assert torch.equal(dequant_fp8_block(q.view(torch.uint8), codes, (bo, bi), torch.float32), want)
    f32 = torch.rand(3, 3) + 0.5
    want = q.float() * f32.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    assert torch.equal(dequant_fp8_block(q, f32, (bo, bi), torch.float32), want)


# --- round trips ----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (7, 300), (128, 256), (129, 127), (300, 200)])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_fp8_round_trip_within_e4m3_precision(shape, scale_fmt):
    w = torch.randn(shape) * torch.logspace(-3, 2, shape[1])  # blocks of very different magnitude
    q, s = quantize_fp8_block(w, (128, 128), scale_fmt)
    nb = (-(-shape[0] // 128), -(-shape[1] // 128))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == nb
    assert s.dtype == (torch.float8_e8m0fnu if scale_fmt else torch.float32)
    sf = e8m0_to_float(s) if scale_fmt else s
    full = sf.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    amax = (w / full).abs().max()  # float32 scales are rounded, so allow an ulp over 448
    assert amax <= 448 * (1 + 2**-23) and (scale_fmt is None or amax > 224 or w.abs().max() == 0)
    # 3 mantissa bits: half an ulp is 2**-4 of the value; e4m3 subnormals are 2**-9 apart
    bound = w.abs() * 2**-4 + full * 2**-10
    err = (dequant_fp8_block(q, s, (128, 128), torch.float32) - w).abs()
    assert (err <= bound).all(), (err - bound).max()


def test_fp8_quantize_zero_block_and_power_of_two_scales():
    w = torch.zeros(4, 256)
    w[:, 128:] = 896.0  # exactly 448 * 2
    q, s = quantize_fp8_block(w)
    assert s.view(torch.uint8).tolist() == [[127, 128]]
    assert torch.equal(dequant_fp8_block(q, s, dtype=torch.float32), w)


def test_fp4_round_trip_exact_on_grid():
    g = torch.tensor(E2M1)
    exps = torch.randint(-20, 20, (16, 4)).repeat_interleave(32, 1).float()
    w = g[torch.randint(0, 16, (16, 128))] * 2**exps
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (16, 64)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (16, 4)
    assert torch.equal(dequant_fp4(packed, scale, torch.float32), w)


def test_fp4_rounds_to_nearest_with_smallest_scale():
    w = torch.randn(8, 64) * 10
    packed, scale = quantize_fp4(w)
    s = e8m0_to_float(scale).repeat_interleave(32, 1)
    v = w / s
    ratio = v.abs().view(8, 2, 32).amax(-1)
    assert (ratio <= 6).all() and (ratio > 3).all()  # a scale half as big would not fit
    nearest = (v[..., None] - torch.tensor(E2M1)).abs().min(-1).values
    assert torch.allclose((dequant_fp4(packed, scale, torch.float32) / s - v).abs(), nearest)


def test_fp4_ties_round_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    w = torch.stack([ties, -ties])
    got = dequant_fp4(*quantize_fp4(w), torch.float32)
    want = torch.tensor([0, 1, 1, 2, 2, 4, 4, 6.0] * 4)
    assert torch.equal(got, torch.stack([want, -want]))


# --- safetensors ----------------------------------------------------------------------

def test_safetensors_float8_and_int8_read_back_bit_exact(tmp_path):
    q, s8 = quantize_fp8_block(torch.randn(130, 40) * 3)
    packed, s4 = quantize_fp4(torch.randn(6, 64))
    tensors = {"a.weight": q, "a.scale": s8, "e.weight": packed, "e.scale": s4,
               "u": torch.arange(256, dtype=torch.uint8)}
    path = tmp_path / "q.safetensors"
    save_file(tensors, str(path))
    with SafetensorsFile(path) as f:
        for name, t in tensors.items():
            got = f.read(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
            dest = torch.empty_like(t)
            f.read_into(name, dest)
            assert torch.equal(dest.view(torch.uint8), t.view(torch.uint8)), name
        row = torch.empty(40, dtype=torch.float8_e4m3fn)
        f.read_row_into("a.weight", 129, row)
        assert torch.equal(row.view(torch.uint8), q[129].view(torch.uint8))
        wide = torch.empty(130, 40, dtype=torch.bfloat16)
        f.read_into("a.weight", wide)  # a casting read of e4m3 is exact in bf16
        assert torch.equal(wide, q.to(torch.bfloat16))
        assert torch.equal(dequant_fp8_block(f.read("a.weight"), f.read("a.scale")),
                           dequant_fp8_block(q, s8))


# --- errors ---------------------------------------------------------------------------

def test_fp8_scale_shape_mismatch_is_explained():
    q = torch.zeros(300, 200, dtype=torch.float8_e4m3fn)
    msg = r"scale has shape \(2, 2\), expected \(3, 2\) for a \[300, 200\] weight in 128x128 blocks"
    with pytest.raises(ValueError, match=msg):
        dequant_fp8_block(q, torch.ones(2, 2), (128, 128))


def test_fp8_weight_dtype_is_checked():
    with pytest.raises(ValueError, match="fp8 weight must be float8_e4m3fn or uint8, got torch.bfloat16"):
        dequant_fp8_block(torch.zeros(4, 4, dtype=torch.bfloat16), torch.ones(1, 1))


def test_fp4_shape_mismatches_are_explained():
    packed = torch.zeros(4, 32, dtype=torch.int8)
    msg = r"scale has shape \(4, 1\), expected \(4, 2\) for a \[4, 64\] fp4 weight in groups of 32"
    with pytest.raises(ValueError, match=msg):
        dequant_fp4(packed, _e8m0([[127]] * 4))
    with pytest.raises(ValueError, match="fp4 weight has 40 inputs, not a multiple of the scale group 32"):
        dequant_fp4(torch.zeros(4, 20, dtype=torch.int8), _e8m0([[127]] * 4))
    with pytest.raises(ValueError, match="e8m0 scale must be uint8, float8_e8m0fnu, got torch.float32"):
        dequant_fp4(packed, torch.ones(4, 2))


# --- QuantSpec ------------------------------------------------------------------------

def test_quant_spec_v4_flash():
    spec = QuantSpec.from_config({"quantization_config": V4_QUANT, "expert_dtype": "fp4"}, "config.json")
    assert spec == QuantSpec(fmt="e4m3", block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")


def test_quant_spec_defaults_and_absent():
    assert QuantSpec.from_config({"hidden_size": 64}, "config.json") is None
    spec = QuantSpec.from_config({"quantization_config": {"quant_method": "fp8", "expert_dtype": "fp8"}}, "c")
    assert spec == QuantSpec("e4m3", (128, 128), None, "fp8")


@pytest.mark.parametrize("change,msg", [
    ({"quant_method": "awq"}, r"config\.json: quantization_config\.quant_method 'awq' is not supported \(fp8\)"),
    ({"fmt": "e5m2"}, r"config\.json: quantization_config\.fmt 'e5m2' is not supported \(e4m3\)"),
    ({"weight_block_size": [128]}, r"config\.json: quantization_config\.weight_block_size \[128\] is not two"),
    ({"scale_fmt": "e4m3"}, r"config\.json: quantization_config\.scale_fmt 'e4m3' is not supported"),
    ({"expert_dtype": "int4"}, r"config\.json: quantization_config\.expert_dtype 'int4' is not supported"),
])
def test_quant_spec_errors_name_the_key(change, msg):
    with pytest.raises(ValueError, match=msg):
        QuantSpec.from_config({"quantization_config": {**V4_QUANT, **change}}, "config.json")


def test_quant_spec_conflicting_expert_dtype():
    raw = {"expert_dtype": "fp4", "quantization_config": {**V4_QUANT, "expert_dtype": "fp8"}}
    with pytest.raises(ValueError, match="expert_dtype 'fp4' and quantization_config.expert_dtype 'fp8' disagree"):
        QuantSpec.from_config(raw, "config.json")
    with pytest.raises(ValueError, match=r"config\.json: expert_dtype 'nf4' is not supported"):
        QuantSpec.from_config({"expert_dtype": "nf4", "quantization_config": V4_QUANT}, "config.json")
