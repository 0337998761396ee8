"""Block-quantized DeepSeek weights: the config's quant spec, dequantization, and its inverse.

Pure tensor functions; reading the files is safetensors_io's job.

Glossary
- e4m3: FP8 with 4 exponent and 3 mantissa bits (torch.float8_e4m3fn), largest value 448.
  Most linear weights are e4m3, [out, in], with one scale per `block` (128x128) tile in a
  companion `<prefix>.scale` tensor of shape [ceil(out/128), ceil(in/128)].
- e8m0 ("ue8m0"): a bare 8-bit exponent, value 2**(e - 127), e = 255 is NaN
  (torch.float8_e8m0fnu). Power-of-two scales make dequantization an exact exponent shift.
  Older checkpoints store the same block scales as float32 instead.
- e2m1: FP4, sign in bit 3, magnitudes [0, 0.5, 1, 1.5, 2, 3, 4, 6] for codes 0..7. Routed
  experts are e2m1 when the config says expert_dtype "fp4": two codes per byte (element 2k
  in the low nibble of byte k), stored as I8 [out, in // 2], with one e8m0 scale per 32
  consecutive inputs, [out, in // 32].

Dequantization multiplies in float32 and rounds once to the target dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# None before torch 2.7; the functions then take and give e8m0 as raw uint8.
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
# Midpoints between neighbouring e2m1 magnitudes, for rounding to the nearest one.
_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_EXPERT_DTYPES = ("fp4", "fp8")


@dataclass(frozen=True)
class QuantSpec:
    fmt: str = "e4m3"
    block: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None  # "ue8m0", or None for float32 scales
    expert_dtype: str | None = None  # "fp4", "fp8", or None (experts quantized like the rest)

    @classmethod
    def from_config(cls, raw: dict, source: str) -> QuantSpec | None:
        """The spec in a HF config.json dict, or None for an unquantized checkpoint.

        Args:
            raw: the parsed config.json.
            source: named in every error, e.g. the file's path.
        Raises:
            ValueError: a quantization this module cannot dequantize, or a malformed field.
        """
        qc = raw.get("quantization_config")
        if qc is None:
            return None
        if not isinstance(qc, dict):
            raise ValueError(f"{source}: quantization_config must be an object, got {qc!r}")
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not supported (fp8)")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{source}: quantization_config.fmt {fmt!r} is not supported (e4m3)")
        block = qc.get("weight_block_size", [128, 128])
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"{source}: quantization_config.weight_block_size {block!r} is not two positive ints")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt == "float":
            scale_fmt = None
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"{source}: quantization_config.scale_fmt {scale_fmt!r} is not supported (ue8m0, float)")
        top, inner = raw.get("expert_dtype"), qc.get("expert_dtype")
        if top is not None and inner is not None and top != inner:
            raise ValueError(f"{source}: expert_dtype {top!r} and quantization_config.expert_dtype {inner!r} disagree")
        expert_dtype = top if top is not None else inner
        if expert_dtype not in (None, *_EXPERT_DTYPES):
            key = "expert_dtype" if top is not None else "quantization_config.expert_dtype"
            raise ValueError(f"{source}: {key} {expert_dtype!r} is not supported (fp4, fp8)")
        return cls(fmt, (block[0], block[1]), scale_fmt, expert_dtype)


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """float32 values of e8m0 exponents (float8_e8m0fnu or raw uint8), built bit by bit.

    float32 has e8m0's bias, so e is exactly float32's exponent field; building the bits
    needs no float8 support from torch (or the device), and 2**-127 stays exact.
    """
    e = _raw_bytes(t, "e8m0 scale", _E8M0).to(torch.int32)
    bits = torch.where(e == 0, 1 << 22, e << 23)  # 2**-127 is a float32 subnormal
    bits = torch.where(e == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """w * its block's scale, [out, in], in `dtype`.

    Args:
        w: float8_e4m3fn (or its raw uint8 bytes), [out, in].
        scale: float32, float8_e8m0fnu or raw uint8 e8m0, [ceil(out/bo), ceil(in/bi)].
        block: (bo, bi), the tile one scale covers; edge tiles may be partial.
    """
    if w.dim() != 2:
        raise ValueError(f"fp8 weight must be 2-D [out, in], got shape {tuple(w.shape)}")
    (out, inp), (bo, bi) = w.shape, block
    nbo, nbi = -(-out // bo), -(-inp // bi)
    if tuple(scale.shape) != (nbo, nbi):
        raise ValueError(f"scale has shape {tuple(scale.shape)}, expected {(nbo, nbi)} "
                         f"for a [{out}, {inp}] weight in {bo}x{bi} blocks")
    if w.dtype == torch.uint8:
        w = w.view(torch.float8_e4m3fn)
    elif w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 weight must be float8_e4m3fn or uint8, got {w.dtype}")
    s = _scale_to_float(scale).to(w.device)
    x = F.pad(w.float(), (0, nbi * bi - inp, 0, nbo * bo - out))
    x = x.view(nbo, bo, nbi, bi).mul_(s[:, None, :, None]).view(nbo * bo, nbi * bi)
    return x[:out, :inp].to(dtype).contiguous()


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                group: int = 32) -> torch.Tensor:
    """e2m1 codes times their group's power-of-two scale, [out, in], in `dtype`.

    Args:
        packed: int8/uint8 (or float4_e2m1fn_x2), [out, in // 2], two codes per byte, low first.
        scale: float8_e8m0fnu or raw uint8 e8m0, [out, in // group].
    """
    if packed.dim() != 2:
        raise ValueError(f"fp4 weight must be 2-D [out, in // 2], got shape {tuple(packed.shape)}")
    out, inp = packed.shape[0], packed.shape[1] * 2
    if inp % group:
        raise ValueError(f"fp4 weight has {inp} inputs, not a multiple of the scale group {group}")
    if tuple(scale.shape) != (out, inp // group):
        raise ValueError(f"scale has shape {tuple(scale.shape)}, expected {(out, inp // group)} "
                         f"for a [{out}, {inp}] fp4 weight in groups of {group}")
    b = _raw_bytes(packed, "fp4 weight", torch.int8, getattr(torch, "float4_e2m1fn_x2", None))
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).view(out, inp)
    x = _E2M1.to(b.device)[codes.int()].view(out, inp // group, group)
    x.mul_(e8m0_to_float(scale).to(b.device)[..., None])
    return x.view(out, inp).to(dtype)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                       scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of dequant_fp8_block, to write checkpoints in the published format.

    Each block's scale maps its largest |w| to at most 448; "ue8m0" rounds the scale up to a
    power of two (stored as e8m0), None keeps it exact (float32).

    Returns:
        (float8_e4m3fn [out, in], scale [ceil(out/bo), ceil(in/bi)]).
    """
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"scale_fmt {scale_fmt!r} is not supported (ue8m0, None)")
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(w.shape)}")
    (out, inp), (bo, bi) = w.shape, block
    nbo, nbi = -(-out // bo), -(-inp // bi)
    x = F.pad(w.float(), (0, nbi * bi - inp, 0, nbo * bo - out)).view(nbo, bo, nbi, bi)
    amax = x.abs().amax(dim=(1, 3))  # [nbo, nbi]
    if scale_fmt == "ue8m0":
        stored = _e8m0_from_exponent(_ceil_log2(amax / E4M3_MAX))
        s = e8m0_to_float(stored)
    else:
        s = torch.where(amax > 0, amax / E4M3_MAX, 1.0)  # an all-zero block needs any nonzero scale
        stored = s
    q = (x / s[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).view(nbo * bo, nbi * bi)
    return q[:out, :inp].to(torch.float8_e4m3fn).contiguous(), stored


def quantize_fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of dequant_fp4: the smallest power-of-two scale per group that brings
    every |w| within 6, then each value rounded to the nearest e2m1 (ties to even).

    Returns:
        (int8 [out, in // 2], e8m0 scale [out, in // group]).
    """
    if w.dim() != 2 or w.shape[1] % group or group % 2:
        raise ValueError(f"weight must be 2-D with inputs a multiple of an even group {group}, "
                         f"got shape {tuple(w.shape)}")
    out, inp = w.shape
    x = w.float().view(out, inp // group, group)
    stored = _e8m0_from_exponent(_ceil_log2(x.abs().amax(dim=-1) / E2M1_MAX))  # [out, in // group]
    v = (x / e8m0_to_float(stored)[..., None]).clamp_(-E2M1_MAX, E2M1_MAX).view(out, inp)
    mag, mids = v.abs(), _E2M1_MIDS.to(v.device)
    code = torch.bucketize(mag, mids)  # a tie lands on the lower code
    tie = (mag == mids[code.clamp(max=len(mids) - 1)]) & (code % 2 == 1)
    code = (code + tie.long()) | torch.where(v < 0, 8, 0)
    pairs = code.to(torch.uint8).view(out, inp // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.view(torch.int8), stored


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) exactly for x >= 0 (0 for x == 0), clamped to e8m0's range."""
    mant, exp = torch.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    exp = exp - (mant == 0.5).to(exp.dtype)  # an exact power of two needs no rounding up
    return exp.clamp_(-127, 127)


def _e8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    raw = (exp + 127).to(torch.uint8)
    return raw.view(_E8M0) if _E8M0 is not None else raw


def _scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return scale.float()
    return e8m0_to_float(scale)


def _raw_bytes(t: torch.Tensor, what: str, *also: torch.dtype | None) -> torch.Tensor:
    """t's bytes as uint8; t must be uint8 or one of `also` (None entries: absent in this torch)."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype in also:
        return t.view(torch.uint8)
    names = ", ".join(str(d).removeprefix("torch.") for d in (torch.uint8, *also) if d is not None)
    raise ValueError(f"{what} must be {names}, got {t.dtype}")
