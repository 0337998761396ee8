"""Greedy generation on a model directory, with the torch path and then with every kernel
forced on. Run as a script so that TRITON_INTERPRET=1 is in place before anything in the
process imports triton:

    TRITON_INTERPRET=1 python -m tests.kernels.engine_check MODEL_DIR

Prints one JSON object: each path's outputs and how often each kernel launched.
"""

from __future__ import annotations

import json
import os
import random
import sys

from moemesh.shared.checkpoint.loader import load_model
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.protocol.messages import SamplingParams
from moemesh.shared.kernels import (fused_moe, hyper, kv_pack, mla_decode, rmsnorm, rotary, route, swiglu, v4_attention,
                                    v4_compress, v4_indexer, v4_rope)

NEW_TOKENS = 4  # the interpreter is slow; a few steps of each path are enough (V4: groups complete at 3, 7, 35)
PROMPT_LENS = [1, 7, 33]  # one token, one partial block, three blocks (block_size 16)
KERNELS = {
    "rms_norm": rmsnorm._rms_norm_kernel,
    "rope_cache": rotary._rotary_kernel,
    "mla_decode": mla_decode._mla_decode_kernel,
    "fused_moe": fused_moe._fused_moe_kernel,
    "kv_pack": kv_pack._kv_pack_kernel,
    "route": route._route_kernel,
    "hc_mix": hyper._hc_mix_kernel,
    "hc_merge": hyper._hc_merge_kernel,
    "v4_rope": v4_rope._v4_rope_kernel,
    "v4_decode_attention": v4_attention._v4_decode_attn_kernel,
    "v4_index_scores": v4_indexer._index_scores_kernel,
    "v4_compress": v4_compress._compress_kernel,
    "swiglu": swiglu._swiglu_kernel,
}
V4_ONLY = ("hc_mix", "hc_merge", "v4_rope", "v4_decode_attention", "v4_index_scores", "v4_compress")


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[0] + [rng.randrange(4, vocab) for _ in range(n - 1)] for n in PROMPT_LENS]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _generate(make, vocab: int) -> dict[str, list[int]]:
    """Batched, with MTP drafts: decode rows, prefill chunks and draft verification."""
    eng = make(num_kv_blocks=64, num_speculative_tokens=1)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(_prompts(vocab)):
        eng.add_request(f"r{i}", p, _greedy())
        outs[f"r{i}"] = []
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    return outs


def _disaggregated(make, vocab: int) -> list[int]:
    """Prefill on one engine, pack its KV blocks, unpack them into another, decode there."""
    pre = make(num_kv_blocks=16, role="prefill")
    dec = make(num_kv_blocks=16, role="decode", num_speculative_tokens=0)
    prompt = _prompts(vocab)[-1]
    pre.add_request("r", prompt, _greedy())
    first: list[int] = []
    while not first:  # the prompt may take more than one step (V4 cuts it at a boundary it snapshots)
        first = [t for o in pre.step() for t in o.new_token_ids]
    kv = pre.export_kv("r").clone()
    pre.release("r")
    dec.add_prefilled("r", prompt + first, len(prompt), _greedy(), kv)
    out = list(first)
    while dec.has_unfinished():
        out += [t for o in dec.step() for t in o.new_token_ids]
    return out


def main(model_dir: str) -> dict:
    model = load_model(model_dir)

    def make(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model_dir, **kw), model=model)

    vocab = model.cfg.vocab_size
    result = {}
    # V4's hand-off moves its state with torch copies (no pack kernel): its batched run, with
    # prefill chunks, decode rows and draft verification, is what the kernels change.
    v4 = model.cfg.model_type == "deepseek_v4"
    for mode in ("torch", "triton"):
        os.environ["MOEMESH_KERNELS"] = mode
        result[mode] = {"batched": _generate(make, vocab)}
        if not v4:
            result[mode]["disaggregated"] = _disaggregated(make, vocab)
    result["launches"] = {name: k.num_launches for name, k in KERNELS.items()}
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
