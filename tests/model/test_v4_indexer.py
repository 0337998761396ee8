"""V4's compressor pooling, lightning-indexer scores and top-k selection, against the
paper's equations (DeepSeek-V4 report §2.3.1) written out as plain loops, and against
transformers' modules as a cross-check.

Equations, for a compression rate m and entry w (positions w*m .. w*m+m-1):
- HCA:  C_w = sum_{j<m} softmax_j(Z_{wm+j} + B_j) * C_{wm+j}, per channel;
- CSA:  the same over 2m slots, slots j < m holding the previous group's first series
        (Ca, B[:, :d]) and slots m+j this group's second series (Cb, B[:, d:]); before
        position 0 a slot is empty (weight 0);
- entry = RoPE_{w*m}(RMSNorm(C_w)) on the trailing rope channels, interleaved pairs;
- I_{t,s} = sum_h w_{t,h} * ReLU(q_{t,h} . K_s) * d_I^-0.5, w_t = W_w h_t * n_h^-0.5,
  q_{t,h} = RoPE_t(W_qb[h] c_t) with the compress rope;
- query t keeps its top-k entries among s < (t+1)//m (all of them when fewer).
"""

from __future__ import annotations

import math

import pytest
import torch

from moemesh.shared.model.config import RopeConfig
from moemesh.shared.model.v4.batch import Groups
from moemesh.shared.model.v4.compressor import Compressor, Indexer
from moemesh.shared.model.v4.rope import Rope

D, Q_LORA, EPS = 48, 24, 1e-6
ROPES = {
    "default": RopeConfig(theta=10000.0),
    "yarn": RopeConfig(theta=160000.0, kind="yarn", factor=4.0, original_max_position_embeddings=64,
                       beta_fast=32.0, beta_slow=1.0),  # attention factor from the factor: 1.139
}


def _fill(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter from one seeded generator (they are created with torch.empty)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            x = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                x = 1.0 + 0.2 * x
            elif name.endswith("position_bias"):
                x = 0.7 * x
            else:
                x = x / math.sqrt(p.shape[-1])
            p.copy_(x)
    return module.requires_grad_(False)


# ---- the reference, loop by loop --------------------------------------------------------

def _inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Plain RoPE from its definition; YaRN's table from transformers (cross-checked there)."""
    if rope.kind == "default":
        return 1.0 / rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    compress = {"rope_type": "yarn", "rope_theta": rope.theta, "factor": rope.factor,
                "original_max_position_embeddings": rope.original_max_position_embeddings,
                "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow}
    main = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = DeepseekV4Config(head_dim=64, partial_rotary_factor=dim / 64, num_hidden_layers=2,
                           rope_parameters={"main": main, "compress": compress})
    emb = DeepseekV4RotaryEmbedding(cfg)
    return emb.compress_inv_freq, emb.compress_attention_scaling


class Ref:
    def __init__(self, rope: RopeConfig, rope_dim: int):
        self.inv_freq, self.attn = _inv_freq(rope, rope_dim)

    def rotate(self, v: list[float], pos: int) -> list[float]:
        """Interleaved pairs (x_{2i}, x_{2i+1}) of the trailing rope channels, at `pos`."""
        out = list(v)
        base = len(v) - 2 * len(self.inv_freq)
        for i, f in enumerate(self.inv_freq.tolist()):
            angle = float(torch.tensor(float(pos)) * torch.tensor(f))  # fp32, as both models compute it
            c, s = math.cos(angle) * self.attn, math.sin(angle) * self.attn
            x1, x2 = v[base + 2 * i], v[base + 2 * i + 1]
            out[base + 2 * i] = x1 * c - x2 * s
            out[base + 2 * i + 1] = x2 * c + x1 * s
        return out

    def entry(self, comp: Compressor, h: torch.Tensor, w: int) -> list[float]:
        """Entry w of the positions whose hidden states are h [P, D]."""
        m, d = comp.rate, comp.width
        C = (h.double() @ comp.kv_proj.weight.double().T).tolist()  # [P, series * d]
        Z = (h.double() @ comp.gate_proj.weight.double().T).tolist()
        B = comp.position_bias.double().tolist()  # [m, series * d]
        pooled = []
        for c in range(d):
            slots = []  # (logit, value)
            if comp.overlap:
                for j in range(m):
                    p = (w - 1) * m + j
                    if p >= 0:
                        slots.append((Z[p][c] + B[j][c], C[p][c]))
                for j in range(m):
                    p = w * m + j
                    slots.append((Z[p][d + c] + B[j][d + c], C[p][d + c]))
            else:
                for j in range(m):
                    p = w * m + j
                    slots.append((Z[p][c] + B[j][c], C[p][c]))
            top = max(z for z, _ in slots)
            weights = [math.exp(z - top) for z, _ in slots]
            pooled.append(sum(a * v for a, (_, v) in zip(weights, slots)) / sum(weights))
        rms = math.sqrt(sum(x * x for x in pooled) / d + comp.kv_norm.eps)
        g = comp.kv_norm.weight.tolist()
        return self.rotate([x / rms * g[c] for c, x in enumerate(pooled)], w * m)

    def scores(self, ix: Indexer, q_res: torch.Tensor, x: torch.Tensor, positions: list[int],
               keys: torch.Tensor) -> list[list[float]]:
        H, d = ix.n_heads, ix.width
        Wq = ix.q_b_proj.weight.double()
        Ww = ix.scorer.weights_proj.weight.double()
        out = []
        for r, t in enumerate(positions):
            row_keys = (keys[r] if keys.dim() == 3 else keys).double().tolist()
            q = [self.rotate((Wq[h * d:(h + 1) * d] @ q_res[r].double()).tolist(), t) for h in range(H)]
            wt = [float(Ww[h] @ x[r].double()) * H**-0.5 for h in range(H)]
            row = []
            for k in row_keys:
                total = 0.0
                for h in range(H):
                    dot = sum(a * b for a, b in zip(q[h], k))
                    total += wt[h] * max(dot, 0.0) * d**-0.5
                row.append(total)
            out.append(row)
        return out


def ref_select(scores: list[float], t: int, m: int, k: int) -> set[int]:
    visible = (t + 1) // m
    order = sorted(range(visible), key=lambda s: -scores[s])
    return set(order[:k])


# ---- helpers for the module side --------------------------------------------------------

def _ctx(comp: Compressor, h: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[int]]:
    """The projections in a shuffled ctx order, with junk rows between; row_of[p] is the ctx
    row of position p (as the batch's rows and pre positions are interleaved in practice)."""
    g = torch.Generator().manual_seed(seed)
    proj = comp.project(h)
    P = proj.shape[0]
    junk = torch.randn(P // 2 + 1, proj.shape[1], generator=g)
    rows = torch.cat([proj, junk])
    perm = torch.randperm(rows.shape[0], generator=g)
    ctx = rows[perm]
    row_of = [0] * P
    for i, src in enumerate(perm.tolist()):
        if src < P:
            row_of[src] = i
    return ctx, row_of


def _groups(comp: Compressor, ws: list[int], row_of: list[int]) -> Groups:
    m = comp.rate
    idx = []
    for w in ws:
        span = range((w - 1) * m, (w + 1) * m) if comp.overlap else range(w * m, (w + 1) * m)
        idx.append([row_of[p] if p >= 0 else -1 for p in span])
    n = len(ws)
    return Groups(idx=torch.tensor(idx), pos=torch.tensor([w * m for w in ws]),
                  blk=torch.zeros(n, dtype=torch.long), slot=torch.zeros(n, dtype=torch.long))


def _hidden(P: int, seed: int, width: int = D) -> torch.Tensor:
    return torch.randn(P, width, generator=torch.Generator().manual_seed(seed))


# ---- pooling ------------------------------------------------------------------------

@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("kind,width,rope_dim,rate", [
    ("hca", 32, 8, 8),
    ("hca", 16, 16, 1),  # every position its own entry; the whole head rotated
    ("csa", 32, 8, 4),
    ("csa", 16, 4, 2),
    ("indexer", 24, 8, 4),
])
def test_pool_matches_the_equations(rope, kind, width, rope_dim, rate):
    seed = hash((rope, kind, width, rate)) % 1000
    if kind == "indexer":
        comp = _fill(Indexer(D, Q_LORA, 3, width, rate, topk=4, eps=EPS), seed)
    else:
        comp = _fill(Compressor(D, width, rate, overlap=kind == "csa", eps=EPS), seed)
    n_groups = 5
    h = _hidden(n_groups * rate + rate - 1, seed)  # a trailing incomplete group: never read
    ctx, row_of = _ctx(comp, h, seed)
    ws = [3, 0, 4, 1, 2]  # any order; group 0 has no predecessor
    r = Rope(ROPES[rope], rope_dim)
    got = comp.pool(ctx, _groups(comp, ws, row_of), r)
    assert got.shape == (len(ws), width) and got.dtype == torch.float32
    ref = Ref(ROPES[rope], rope_dim)
    want = torch.tensor([ref.entry(comp, h, w) for w in ws], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_pool_csa_first_group_ignores_what_precedes_it():
    """Group 0's empty slots carry weight 0 whatever the ctx row they clamp to holds, and a
    group reads exactly its two halves: changing any other row changes nothing."""
    comp = _fill(Compressor(D, 16, 4, overlap=True, eps=EPS), 11)
    r = Rope(ROPES["default"], 8)
    h = _hidden(16, 12)
    ctx, row_of = _ctx(comp, h, 13)
    ctx = torch.cat([torch.zeros(1, ctx.shape[1]), ctx])  # row 0: junk, where index -1 lands if clamped
    row_of = [i + 1 for i in row_of]
    groups = _groups(comp, [0, 2], row_of)
    base = comp.pool(ctx, groups, r)
    used = {row_of[p] for p in range(12)}  # group 0: positions 0..3; group 2: 4..7 (Ca) and 8..11 (Cb)
    ctx2 = ctx.clone()
    for row in range(ctx.shape[0]):
        if row not in used:
            ctx2[row] = 1e4
    torch.testing.assert_close(comp.pool(ctx2, groups, r), base, rtol=0, atol=0)
    ctx3 = ctx.clone()
    ctx3[row_of[5]] += 1.0  # a group-1 position: read (as Ca) by group 2 only
    changed = comp.pool(ctx3, groups, r)
    assert (changed[1] - base[1]).abs().max() > 1e-4
    torch.testing.assert_close(changed[0], base[0], rtol=0, atol=0)


def test_pool_overlap_uses_the_two_series_and_their_biases():
    """Ca (first d channels) feeds the next entry, Cb (last d) its own: swapping the halves
    of the projections, or of the position bias, changes the entries."""
    comp = _fill(Compressor(D, 16, 4, overlap=True, eps=EPS), 21)
    r = Rope(ROPES["default"], 8)
    h = _hidden(12, 22)
    ctx, row_of = _ctx(comp, h, 23)
    groups = _groups(comp, [1, 2], row_of)
    base = comp.pool(ctx, groups, r)
    with torch.no_grad():
        comp.position_bias.copy_(torch.cat([comp.position_bias[:, 16:], comp.position_bias[:, :16]], dim=1))
    assert (comp.pool(ctx, groups, r) - base).abs().max() > 1e-3


# ---- scores ---------------------------------------------------------------------------

@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("shared_keys", [True, False])
def test_scores_match_the_equations(rope, shared_keys):
    H, d, E = 5, 16, 7
    ix = _fill(Indexer(D, Q_LORA, H, d, 4, topk=3, eps=EPS), 31 + shared_keys)
    g = torch.Generator().manual_seed(32)
    positions = [0, 3, 9, 17, 27, 30]
    R = len(positions)
    q_res = torch.randn(R, Q_LORA, generator=g)
    x = torch.randn(R, D, generator=g)
    keys = torch.randn(E, d, generator=g) if shared_keys else torch.randn(R, E, d, generator=g)
    r = Rope(ROPES[rope], 8)
    cos, sin = r.angles(torch.tensor(positions))
    got = ix.scores(q_res, x, cos, sin, keys)
    assert got.shape == (R, E) and got.dtype == torch.float32
    want = torch.tensor(Ref(ROPES[rope], 8).scores(ix, q_res, x, positions, keys), dtype=torch.float64)
    assert (want != 0).sum() > R * E // 2 and (want < 0).any() and (want > 0).any()  # ReLU and signs exercised
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_scores_on_pooled_index_keys():
    """End to end: the indexer's own pooled keys, scored by queries at their positions."""
    m, d = 4, 16
    ix = _fill(Indexer(D, Q_LORA, 4, d, m, topk=2, eps=EPS), 41)
    r, ref = Rope(ROPES["yarn"], 8), Ref(ROPES["yarn"], 8)
    P = 22
    h = _hidden(P, 42)
    q_res = _hidden(P, 43, Q_LORA)
    ctx, row_of = _ctx(ix, h, 44)
    ws = list(range(P // m))
    keys = ix.pool(ctx, _groups(ix, ws, row_of), r)
    positions = list(range(P))
    cos, sin = r.angles(torch.tensor(positions))
    got = ix.scores(q_res, h, cos, sin, keys)
    want_keys = torch.tensor([ref.entry(ix, h, w) for w in ws], dtype=torch.float64)
    want = torch.tensor(ref.scores(ix, q_res, h, positions, want_keys), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


# ---- selection --------------------------------------------------------------------------

@pytest.mark.parametrize("topk,E", [(1, 6), (3, 6), (6, 6), (10, 6), (4, 12), (2, 1)])
def test_select_keeps_the_top_k_visible(topk, E):
    m = 4
    ix = Indexer(D, Q_LORA, 2, 8, m, topk=topk, eps=EPS)
    positions = [0, 1, 2, 3, 4, 7, 8, 11, 13, 15, 17, 21, 22, 23, E * m - 1]
    positions = [t for t in positions if (t + 1) // m <= E]
    g = torch.Generator().manual_seed(topk * 100 + E)
    scores = torch.randn(len(positions), E, generator=g)  # continuous: no ties
    visible = torch.tensor([(t + 1) // m for t in positions])
    top, valid = ix.select(scores, visible)
    k = min(topk, E)
    assert top.shape == valid.shape == (len(positions), k) and valid.dtype == torch.bool
    saw_zero = saw_fewer = saw_more = False
    for r, t in enumerate(positions):
        picked = top[r][valid[r]].tolist()
        want = ref_select(scores[r].tolist(), t, m, topk)
        assert len(picked) == len(set(picked)) == len(want) == min(topk, (t + 1) // m), (r, t)
        assert set(picked) == want, (r, t)
        assert all(0 <= s < (t + 1) // m for s in picked)
        saw_zero |= (t + 1) // m == 0
        saw_fewer |= 0 < (t + 1) // m < topk
        saw_more |= (t + 1) // m > topk
    assert saw_zero and (saw_fewer or topk == 1) and (saw_more or topk >= E)


def test_select_picks_by_score_not_by_position():
    ix = Indexer(D, Q_LORA, 2, 8, 4, topk=2, eps=EPS)
    scores = torch.tensor([[0.1, 0.9, 0.5, 2.0, -1.0],
                           [0.1, 0.9, 0.5, 2.0, -1.0],
                           [0.1, 0.9, 0.5, 2.0, -1.0],
                           [-3.0, -2.0, -1.0, -4.0, -5.0]])
    visible = torch.tensor([5, 3, 1, 5])
    top, valid = ix.select(scores, visible)
    assert [set(top[r][valid[r]].tolist()) for r in range(4)] == [{3, 1}, {1, 2}, {0}, {2, 1}]


def test_select_with_no_entries():
    ix = Indexer(D, Q_LORA, 2, 8, 4, topk=3, eps=EPS)
    top, valid = ix.select(torch.zeros(2, 0), torch.tensor([0, 0]))
    assert top.shape == valid.shape == (2, 0)


# ---- cross-check: transformers' modules ----------------------------------------------------

def _hf_config(rate_csa: int, rate_hca: int, head_dim: int, index_head_dim: int, index_topk: int):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        hidden_size=D, head_dim=head_dim, partial_rotary_factor=8 / head_dim, q_lora_rank=Q_LORA,
        num_attention_heads=2, o_groups=1, num_hidden_layers=2, index_n_heads=4, index_head_dim=index_head_dim,
        index_topk=index_topk, compress_rates={"compressed_sparse_attention": rate_csa,
                                               "heavily_compressed_attention": rate_hca},
        rms_norm_eps=EPS, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
    )


def _compress_rope(hf_cfg) -> Rope:
    p = hf_cfg.rope_parameters["compress"]
    return Rope(RopeConfig(theta=p["rope_theta"], kind="yarn", factor=p["factor"],
                           original_max_position_embeddings=p["original_max_position_embeddings"],
                           beta_fast=p["beta_fast"], beta_slow=p["beta_slow"],
                           attention_factor=p["attention_factor"]), 8)


def test_hca_pool_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HCACompressor

    m, width, S = 8, 32, 43
    cfg = _hf_config(4, m, width, 16, 4)
    ours = _fill(Compressor(D, width, m, overlap=False, eps=EPS), 51)
    theirs = DeepseekV4HCACompressor(cfg)
    theirs.load_state_dict(ours.state_dict())
    h = _hidden(S, 52)
    with torch.no_grad():
        want, _ = theirs(h[None], _hidden(S, 53, Q_LORA)[None], torch.arange(S)[None], None, 0)
    ctx, row_of = _ctx(ours, h, 54)
    ws = list(range(S // m))
    got = ours.pool(ctx, _groups(ours, ws, row_of), _compress_rope(cfg))
    torch.testing.assert_close(got, want[0, 0], rtol=0, atol=1e-5)


def test_csa_pool_scores_and_selection_match_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor

    m, width, ihd, topk, S = 4, 32, 16, 3, 30
    cfg = _hf_config(m, 16, width, ihd, topk)
    ours = _fill(Compressor(D, width, m, overlap=True, eps=EPS), 61)
    ours.indexer = _fill(Indexer(D, Q_LORA, 4, ihd, m, topk, EPS), 62)
    theirs = DeepseekV4CSACompressor(cfg)
    theirs.load_state_dict(ours.state_dict())  # the same parameter names
    h, q_res, positions = _hidden(S, 63), _hidden(S, 64, Q_LORA), torch.arange(S)
    with torch.no_grad():
        want_kv, block_bias = theirs(h[None], q_res[None], positions[None], None, 0)
        want_top = theirs.indexer(h[None], q_res[None], positions[None], None, 0)[0]
    rope = _compress_rope(cfg)
    ws = list(range(S // m))
    ctx, row_of = _ctx(ours, h, 65)
    got_kv = ours.pool(ctx, _groups(ours, ws, row_of), rope)
    torch.testing.assert_close(got_kv, want_kv[0, 0], rtol=0, atol=1e-5)
    ictx, irow_of = _ctx(ours.indexer, h, 66)
    keys = ours.indexer.pool(ictx, _groups(ours.indexer, ws, irow_of), rope)
    cos, sin = rope.angles(positions)
    top, valid = ours.indexer.select(ours.indexer.scores(q_res, h, cos, sin, keys), (positions + 1) // m)
    chosen = block_bias[0, 0] == 0  # [S, E]: the entries transformers lets each query attend to
    for t in range(S):
        mine = set(top[t][valid[t]].tolist())
        assert mine == {s for s in want_top[t].tolist() if s >= 0}, t
        assert mine == set(chosen[t].nonzero().flatten().tolist()), t
    assert any(len(set(top[t][valid[t]].tolist())) == topk < (t + 1) // m for t in range(S))  # a real choice
