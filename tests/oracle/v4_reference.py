"""transformers' DeepseekV4ForCausalLM as the oracle for the V4 engine, and the MTP head's
reference built from transformers' own decoder layer (transformers drops MTP weights).

Greedy outputs come from full forwards (no cache): transformers' cached decode can
break indexer ties differently from its full forward. The reference also checks that
the indexer's choice is unambiguous at every query of every CSA layer (a clear gap
between the k-th and the (k+1)-th score), so that exact agreement is a fair demand.
"""

from __future__ import annotations

import copy
import random

import torch

from moemesh.tools.bench.hf_oracle import draw_prompt, generate_full
from tests.oracle.conftest import Reference

MARGIN = 1e-6  # the engine's scores differ from these by ~1e-7 (another order of fp32 sums)


def _hf(model_dir: str):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def indexer_margin(hf, ids: list[int]) -> float:
    """The smallest gap between the k-th and (k+1)-th indexer score over every query that
    has more visible entries than k, in every CSA layer (inf when none has)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    cfg = hf.config
    k, m = cfg.index_topk, cfg.compress_rates["compressed_sparse_attention"]
    seen: list[torch.Tensor] = []
    orig = M.DeepseekV4IndexerScorer.forward

    def spy(self, *a):
        out = orig(self, *a)
        seen.append(out[0])
        return out

    M.DeepseekV4IndexerScorer.forward = spy
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        M.DeepseekV4IndexerScorer.forward = orig
    worst = float("inf")
    for scores in seen:  # [S, T]
        for t in range(scores.shape[0]):
            vis = (t + 1) // m
            if vis > k:
                v = scores[t, :vis].sort(descending=True).values
                worst = min(worst, float(v[k - 1] - v[k]))
    return worst


def reference(model_dir: str, seed: int, lens: list[int], new_tokens: int) -> Reference:
    hf = _hf(model_dir)
    rng = random.Random(seed)
    vocab = hf.config.vocab_size
    prompts = [draw_prompt(rng, n, vocab) for n in lens]
    outputs, logits = [], []
    with torch.no_grad():
        for p in prompts:
            out = generate_full(hf, p, new_tokens)
            outputs.append(out)
            logits.append(hf(torch.tensor([p + out[:-1]])).logits[0][len(p) - 1:])
            margin = indexer_margin(hf, p + out[:-1])
            assert margin > MARGIN, f"{model_dir}: indexer choice ambiguous (gap {margin:.1e}) for prompt len {len(p)}"
    return Reference(model_dir, prompts, outputs, logits)


def mtp_reference_logits(model_dir: str, ours, ids: list[int]) -> torch.Tensor:
    """MTP logits at positions 0 .. len(ids)-2 (predicting ids[i+2] from ids[i+1] and the
    target's streams at i), computed with transformers' decoder layer holding our MTP
    weights: e = enorm(embed(ids[i+1])), h = hnorm(streams_i), x = e_proj(e) + h_proj(h),
    one sliding-window block, then lm_head(norm(hc_head(x)))."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    hf = _hf(model_dir)
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_layer_types = 1, ["sliding_attention"], ["moe"]
    block = M.DeepseekV4DecoderLayer(cfg, 0).eval()
    mtp = ours.mtp[0]
    state = {k: v for k, v in mtp.state_dict().items()
             if not k.startswith(("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head"))}
    missing, unexpected = block.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    streams: list[torch.Tensor] = []
    hook = hf.model.layers[-1].register_forward_hook(lambda mod, args, out: streams.append(out))
    with torch.no_grad():
        hf(torch.tensor([ids]))
        hook.remove()
        h = streams[0][0, :-1]  # [S-1, hc, D]
        e = mtp.enorm(hf.model.embed_tokens(torch.tensor(ids[1:])))
        x = mtp.e_proj(e).unsqueeze(1) + mtp.h_proj(mtp.hnorm(h))
        S = x.shape[0]
        pos = torch.arange(S)[None]
        rot = hf.model.rotary_emb
        emb = {k: rot(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        q, kk = torch.arange(S)[:, None], torch.arange(S)[None, :]
        visible = (kk <= q) & (kk > q - cfg.sliding_window)
        mask = torch.zeros(1, 1, S, S).masked_fill(~visible, float("-inf"))
        out = block(x[None], input_ids=torch.tensor([ids[1:]]), position_embeddings=emb, position_ids=pos,
                    attention_mask=mask)[0]
        return hf.lm_head(mtp.norm(mtp.hc_head(out))).float()
