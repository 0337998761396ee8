"""MoE routing in one launch per layer: from the router logits to (weights, expert ids).

T = tokens, E = routed experts, K = experts per token, G = expert groups. Per token:
1. scores = sigmoid (V3), softmax (V2) or sqrt(softplus) (V4) of the logits;
2. the choice = scores + e_score_correction_bias (+ the skew mode's choice bias); with
   groups, only the `topk_group` groups of best group score (the sum of a group's top
   two, or its max) stay in the running;
3. ids = the top K of the choice, or a hash layer's fixed experts tid2eid[token id];
4. weights = the scores at the ids, normalised (norm_topk_prob) and scaled
   (routed_scaling_factor): V3 and V4 normalise and then scale, V2 does one or the other.
In torch that is 10-25 launches. The kernel picks the top K by repeated argmax, so its
ids come out best first (torch.topk(sorted=False) promises no order; the set is the
same but for exact ties).
"""

from __future__ import annotations

import torch

from moemesh.shared.kernels._triton import jit, next_pow2, rows_per_program, tl
from moemesh.shared.kernels.dispatch import use_triton

SCORING = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}
GROUP_SCORE = {"top2": 0, "max": 1}


def route_ref(logits: torch.Tensor, top_k: int, scoring: str, *, correction_bias: torch.Tensor | None = None,
              choice_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
              group_score: str = "top2", norm: bool = True, scale: float = 1.0, scale_after_norm: bool = True,
              fixed_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, K] fp32, ids [T, K] int64). fixed_ids [T, K]:
    a hash layer's experts, taken as they are."""
    T, E = logits.shape
    if scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        scores = torch.nn.functional.softplus(logits).sqrt()
    if fixed_ids is not None:
        ids = fixed_ids.long()
    else:
        choice = scores if correction_bias is None else scores + correction_bias
        if choice_bias is not None:
            choice = choice + choice_bias
        if n_group > 1:
            grouped = choice.view(T, n_group, E // n_group)
            if group_score == "top2":
                gs = grouped.topk(min(2, E // n_group), dim=-1)[0].sum(dim=-1)
            else:
                gs = grouped.max(dim=-1).values
            keep = torch.zeros_like(gs).scatter_(1, gs.topk(topk_group, dim=-1, sorted=False)[1], 1.0)
            keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E).bool()
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if scale_after_norm:
        if norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * scale
    elif top_k > 1 and norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * scale
    return weights, ids


@jit
def _route_kernel(
    logit_ptr, bias_ptr, cbias_ptr, tid2eid_ptr, token_ptr, w_ptr, ids_ptr,
    T, E, K, G, topk_group, stride_l, scale,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CBIAS: tl.constexpr, FIXED: tl.constexpr,
    GROUPED: tl.constexpr, GROUP_MAX: tl.constexpr, NORM: tl.constexpr, SCALE_AFTER_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """BLOCK_T tokens per program, as rows of [BLOCK_T, BLOCK_E] tiles."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < T
    e = tl.arange(0, BLOCK_E)
    em = e < E
    m2 = tm[:, None] & em[None, :]
    x = tl.load(logit_ptr + t[:, None] * stride_l + e[None, :], mask=m2, other=float("-inf"))
    x = tl.where(tm[:, None], x, 0.0)  # rows past the end: finite, and never stored
    if SCORING == 0:
        s = 1.0 / (1.0 + tl.exp(-x))
    elif SCORING == 1:
        z = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = z / tl.sum(z, axis=1)[:, None]
    else:  # softplus as torch computes it (linear above 20), with log1p's accuracy for tiny exp(x)
        y = tl.exp(tl.minimum(x, 20.0))
        s = tl.sqrt(tl.where(x > 20.0, x, tl.where(y < 1e-4, y * (1.0 - 0.5 * y), tl.log(1.0 + y))))
    s = tl.where(m2, s, 0.0)
    k = tl.arange(0, BLOCK_K)
    km = k < K
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    if FIXED:
        tok = tl.load(token_ptr + t, mask=tm, other=0)
        ids = tl.load(tid2eid_ptr + tok[:, None] * K + k[None, :], mask=tm[:, None] & km[None, :], other=0)
        ids = ids.to(tl.int64)
    else:
        c = s
        if HAS_BIAS:
            c = c + tl.load(bias_ptr + e, mask=em, other=0.0)[None, :]
        if HAS_CBIAS:
            c = c + tl.load(cbias_ptr + e, mask=em, other=0.0)[None, :]
        c = tl.where(m2, c, float("-inf"))
        if GROUPED:
            per = E // G
            grp = e // per
            gi = tl.arange(0, BLOCK_G)
            gs = tl.full([BLOCK_T, BLOCK_G], float("-inf"), dtype=tl.float32)
            for g in range(0, G):
                member = (em & (grp == g))[None, :]
                v = tl.where(member, c, float("-inf"))
                best = tl.max(v, axis=1)
                if GROUP_MAX:
                    val = best
                else:  # the sum of the group's two best (a tie for first counts twice, as with topk)
                    first = tl.argmax(v, axis=1)
                    second = tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), v), axis=1)
                    val = best + tl.where(per > 1, second, 0.0)
                gs = tl.where(gi[None, :] == g, val[:, None], gs)
            keep = m2 & (e[None, :] < 0)
            for _ in range(0, topk_group):
                top_g = tl.argmax(gs, axis=1)
                keep = keep | (grp[None, :] == top_g[:, None])
                gs = tl.where(gi[None, :] == top_g[:, None], float("-inf"), gs)
            c = tl.where(keep & m2, c, float("-inf"))
        for j in range(0, K):
            pick = tl.argmax(c, axis=1)
            ids = tl.where(k[None, :] == j, pick.to(tl.int64)[:, None], ids)
            c = tl.where(e[None, :] == pick[:, None], float("-inf"), c)
    # the scores at the ids: [BLOCK_T, BLOCK_K, BLOCK_E] -> [BLOCK_T, BLOCK_K]
    w = tl.sum(tl.where(e[None, None, :] == ids[:, :, None], s[:, None, :], 0.0), axis=2)
    w = tl.where(km[None, :], w, 0.0)
    if SCALE_AFTER_NORM:
        if NORM:
            w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
        w = w * scale
    elif NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    else:
        w = w * scale
    out = t[:, None] * K + k[None, :]
    om = tm[:, None] & km[None, :]
    tl.store(w_ptr + out, w, mask=om)
    tl.store(ids_ptr + out, ids, mask=om)


def route(logits: torch.Tensor, top_k: int, scoring: str, *, correction_bias: torch.Tensor | None = None,
          choice_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1, group_score: str = "top2",
          norm: bool = True, scale: float = 1.0, scale_after_norm: bool = True, fixed_ids=None,
          tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None):
    """Same contract as route_ref; CUDA tensors (or MOEMESH_KERNELS=triton) run the kernel.
    A hash layer passes tid2eid and token_ids (the kernel looks its experts up itself)."""
    if not use_triton(logits):
        if tid2eid is not None and fixed_ids is None:
            fixed_ids = tid2eid[token_ids]
        return route_ref(logits, top_k, scoring, correction_bias=correction_bias, choice_bias=choice_bias,
                         n_group=n_group, topk_group=topk_group, group_score=group_score, norm=norm, scale=scale,
                         scale_after_norm=scale_after_norm, fixed_ids=fixed_ids)
    T, E = logits.shape
    if logits.dtype != torch.float32:
        raise ValueError(f"router logits must be float32, got {logits.dtype}")
    if fixed_ids is not None:  # given ids: look them up through an identity table
        tid2eid, token_ids = fixed_ids.contiguous(), torch.arange(T, device=logits.device)
    fixed = tid2eid is not None
    if fixed and (tid2eid.dim() != 2 or tid2eid.shape[1] != top_k):
        raise ValueError(f"tid2eid {tuple(tid2eid.shape)} does not give {top_k} experts per token")
    if n_group > 1 and E % n_group:
        raise ValueError(f"{E} experts do not split into {n_group} groups")
    x = logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    if T:
        dummy = x
        tile = next_pow2(E) * next_pow2(top_k)
        block_t = rows_per_program(T, max(1, min(16, 4096 // tile)), tile)
        _route_kernel[(-(-T // block_t),)](
            x, correction_bias if correction_bias is not None else dummy,
            choice_bias if choice_bias is not None else dummy,
            tid2eid.contiguous() if fixed else dummy, token_ids.contiguous() if fixed else dummy, weights, ids,
            T, E, top_k, n_group, topk_group, x.stride(0), float(scale),
            SCORING=SCORING[scoring], HAS_BIAS=correction_bias is not None, HAS_CBIAS=choice_bias is not None,
            FIXED=fixed, GROUPED=n_group > 1 and not fixed, GROUP_MAX=group_score == "max",
            NORM=norm if scale_after_norm else norm and top_k > 1,
            SCALE_AFTER_NORM=scale_after_norm, BLOCK_T=block_t, BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(top_k),
            BLOCK_G=next_pow2(max(n_group, 1)),
        )
    return weights, ids
