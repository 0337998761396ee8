"""Compile every kernel for sm_90 (H100/H200) with the tiles its launcher picks, on any
machine: triton's own LLVM and bundled ptxas need no GPU. Run it as a script, without
TRITON_INTERPRET, so that triton builds its standard library for the compiler:

    python -m tests.kernels.compile_check

Prints one JSON object: for each kernel configuration, ptxas's registers and spill bytes.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

from moemesh.shared.kernels import (fused_moe, hyper, kv_pack, mla_decode, rmsnorm, rotary, route, swiglu, v4_attention,
                                    v4_compress, v4_indexer, v4_rope)

ARCH = 90
BF16 = "bf16"  # the serving dtype; fp32 and fp16 only change the element type


def _compile(lazy, pointers: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3,
             floats: tuple[str, ...] = ()) -> dict:
    lazy.fn.__globals__["tl"] = tl
    fn = triton.jit(lazy.fn)
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointers.get(name, BF16)
        else:
            sig[name] = "fp32" if name in floats else "i32"
    src = triton.compiler.ASTSource(fn, sig, constexprs=dict(constexprs))
    opts = dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True)
    kernel = triton.compile(src, target=GPUTarget("cuda", ARCH, 32), options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        log = subprocess.run([get_ptxas(ARCH).path, "-v", f"--gpu-name=sm_{ARCH}a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True)
    text = log.stdout + log.stderr
    return {"registers": int(re.search(r"Used (\d+) registers", text).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", text).group(1)),
            "shared_bytes": kernel.metadata.shared}


def main() -> dict:
    out = {}
    C, R = 512, 64  # DeepSeek-V2/V3 latent and rope widths
    for res in (False, True):
        out[f"rms_norm residual={res}"] = _compile(rmsnorm._rms_norm_kernel, {}, dict(HAS_RESIDUAL=res, FP32_WEIGHT=False,
                                                    BLOCK_M=1, BLOCK_D=8192), num_warps=16, floats=("eps",))
    out["rms_norm V4"] = _compile(rmsnorm._rms_norm_kernel, {"w_ptr": "fp32"}, dict(HAS_RESIDUAL=False, FP32_WEIGHT=True,
                                  BLOCK_M=1, BLOCK_D=4096), num_warps=16, floats=("eps",))
    for il in (False, True):
        out[f"rotary interleave={il}"] = _compile(rotary._rotary_kernel, {"cos_ptr": "fp32", "sin_ptr": "fp32",
                                                  "pos_ptr": "i64", "slot_ptr": "i64"},
                                                  dict(INTERLEAVE=il, BLOCK_H=16, BLOCK_HALF=R // 2, BLOCK_C=1),
                                                  num_warps=1)
    for sc in (False, True):
        out[f"kv_pack scatter={sc}"] = _compile(kv_pack._kv_pack_kernel, {"ids_ptr": "i64"},
                                                dict(SCATTER=sc, BLOCK=2048))
    tiles = mla_decode._tiles(C, R, torch.bfloat16)
    launch = {k: tiles.pop(k) for k in ("num_warps", "num_stages")}
    part = {"bt_ptr": "i64", "lens_ptr": "i64", "part_o_ptr": "fp32", "part_lse_ptr": "fp32"}
    out["mla_decode"] = _compile(mla_decode._mla_decode_kernel, part, tiles, floats=("scale",), **launch)
    out["mla_decode_reduce"] = _compile(mla_decode._mla_decode_reduce_kernel, part, dict(BLOCK_S=64, BLOCK_C=128))
    moe = {"pairs_ptr": "i64", "block_slot_ptr": "i64"}
    for bm, (bn, bk, warps) in fused_moe._TILES.items():
        for gate_up in (True, False):
            out[f"fused_moe M={bm} gate_up={gate_up}"] = _compile(
                fused_moe._fused_moe_kernel, moe,
                dict(GATE_UP=gate_up, A_PER_TOKEN=gate_up, PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk),
                num_warps=warps)
    out["moe_combine"] = _compile(fused_moe._moe_combine_kernel, {"ids_ptr": "i64", "w_ptr": "fp32"},
                                  dict(BLOCK_K=8, BLOCK_D=1024))
    i64 = {"ids_ptr": "i64", "pairs_ptr": "i64", "block_slot_ptr": "i64"}
    bp, bs, warps = fused_moe.align_tiles(256)
    out["moe_align E=256"] = _compile(fused_moe._moe_align_kernel, i64, dict(BLOCK_P=bp, BLOCK_S=bs), num_warps=warps)
    f32 = dict.fromkeys(("logit_ptr", "bias_ptr", "cbias_ptr", "w_ptr"), "fp32") | {"tid2eid_ptr": "i64",
                                                                                   "token_ptr": "i64", "ids_ptr": "i64"}
    for name, (E, K, G) in {"v3": (256, 8, 8), "v4": (256, 6, 1)}.items():
        bt = max(1, min(16, 4096 // (E * triton.next_power_of_2(K))))
        out[f"route {name}"] = _compile(route._route_kernel, f32, dict(
            SCORING=0 if name == "v3" else 2, HAS_BIAS=True, HAS_CBIAS=False, FIXED=False, GROUPED=G > 1,
            GROUP_MAX=False, NORM=True, SCALE_AFTER_NORM=True, BLOCK_T=bt, BLOCK_E=E,
            BLOCK_K=triton.next_power_of_2(K), BLOCK_G=G), floats=("scale",))
    # DeepSeek-V4-Flash: hidden 4096, hc_mult 4, head_dim 512 (rope 64), 64 heads, index 64 x 128.
    hc = dict.fromkeys(("mix_ptr", "base_ptr", "scale_ptr", "post_ptr", "comb_ptr"), "fp32")
    for full in (True, False):
        out[f"hc_mix full={full}"] = _compile(hyper._hc_mix_kernel, hc, dict(ITERS=20, FULL=full, BLOCK_T=4, BLOCK_N=4,
                                                                          BLOCK_D=256), floats=("hc_eps", "norm_eps"))
    out["hc_merge"] = _compile(hyper._hc_merge_kernel, {"post_ptr": "fp32", "comb_ptr": "fp32"},
                               dict(BLOCK_T=8, BLOCK_N=4, BLOCK_D=128))
    for rms in (False, True):
        out[f"v4_rope rms={rms}"] = _compile(v4_rope._v4_rope_kernel, {"cos_ptr": "fp32", "sin_ptr": "fp32"},
                                             dict(SIGN=1.0, RMS=rms, BLOCK_ROWS=16, BLOCK_D=512, BLOCK_R=32),
                                             floats=("eps",))
    att = {"win_ptr": "i64", "table_ptr": "i64", "sel_ptr": "i64", "vis_ptr": "i64", "sink_ptr": "fp32"}
    for mode in (0, 1, 2):
        bh, bd, bk, warps = v4_attention.attention_tiles(64, 512, mode)
        out[f"v4_decode_attention mode={mode}"] = _compile(
            v4_attention._v4_decode_attn_kernel, att,
            dict(MODE=mode, PRECISION="tf32", BLOCK_H=bh, BLOCK_D=bd, BLOCK_K=bk), num_warps=warps, floats=("scale",))
    out["v4_index_scores"] = _compile(
        v4_indexer._index_scores_kernel, {"q_ptr": "fp32", "w_ptr": "fp32", "table_ptr": "i64", "vis_ptr": "i64",
                                          "out_ptr": "fp32"},
        dict(PRECISION="tf32", BLOCK_H=64, BLOCK_W=128, BLOCK_E=64), floats=("scale",))
    comp = dict.fromkeys(("pre_ring_ptr", "pre_slot_ptr", "idx_ptr", "pos_ptr", "blk_ptr", "slot_ptr"), "i64")
    comp |= {"bias_ptr": "fp32", "inv_ptr": "fp32", "w_ptr": "fp32"}
    for name, span, width, overlap in (("CSA", 8, 512, True), ("HCA", 128, 512, False), ("indexer", 8, 128, True)):
        bs, bw = v4_compress.compress_tiles(span, width)
        out[f"v4_compress {name}"] = _compile(v4_compress._compress_kernel, comp,
                                              dict(OVERLAP=overlap, BIAS_F32=True, BLOCK_S=bs, BLOCK_W=bw),
                                              floats=("eps", "factor"))
    out["rope_cache"] = _compile(rotary._rotary_kernel, {"cos_ptr": "fp32", "sin_ptr": "fp32", "pos_ptr": "i64",
                                                             "slot_ptr": "i64"},
                                 dict(INTERLEAVE=True, BLOCK_H=16, BLOCK_HALF=32, BLOCK_C=512), num_warps=1)
    out["swiglu clamp"] = _compile(swiglu._swiglu_kernel, {}, dict(CLAMP=True, BLOCK=1024), floats=("limit",))
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
