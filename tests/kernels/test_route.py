from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.route import _route_kernel, route, route_ref
from tests.kernels.cases import launches, randn

CPU = [pytest.param("cpu", id="cpu")]
CASES = {  # name: (E, K, scoring, n_group, topk_group, group_score, scale_after_norm)
    "v3-grouped": (16, 4, "sigmoid", 4, 2, "top2", True),
    "v3-256": (256, 8, "sigmoid", 8, 4, "top2", True),
    "v2-greedy-groups": (160, 6, "softmax", 8, 3, "max", False),  # groups of 20: not a power of two
    "v2-plain": (64, 6, "softmax", 1, 1, "top2", False),
    "v2-one": (7, 1, "softmax", 1, 1, "top2", False),
    "v4": (8, 2, "sqrtsoftplus", 1, 1, "top2", True),
    "v4-256": (256, 6, "sqrtsoftplus", 1, 1, "top2", True),
}


def _same_choice(got, want):
    """Same experts with the same weights; the kernel lists them best first."""
    (gw, gi), (ww, wi) = got, want
    order_g, order_w = gi.sort(dim=-1), wi.sort(dim=-1)
    assert torch.equal(order_g.values, order_w.values)
    torch.testing.assert_close(gw.gather(1, order_g.indices), ww.gather(1, order_w.indices), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", CPU)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("T", [1, 7, 19])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_reference(force_triton, device, case, T, norm):
    force_triton(device)
    E, K, scoring, G, TG, gscore, after = CASES[case]
    logits = randn(T, E, dtype=torch.float32, device=device, seed=T, scale=2.0)
    bias = randn(E, dtype=torch.float32, device=device, seed=1, scale=0.1) if scoring != "softmax" else None
    kw = dict(correction_bias=bias, n_group=G, topk_group=TG, group_score=gscore, norm=norm, scale=2.5,
              scale_after_norm=after)
    with launches(_route_kernel):
        got = route(logits, K, scoring, **kw)
    _same_choice(got, route_ref(logits, K, scoring, **kw))


def test_the_choice_bias_moves_the_choice_not_the_weights(force_triton):
    force_triton("cpu")
    logits = randn(9, 16, dtype=torch.float32, device="cpu", seed=5)
    push = torch.zeros(16)
    push[3] = 100.0
    w, ids = route(logits, 4, "sigmoid", choice_bias=push, n_group=4, topk_group=2)
    assert (ids == 3).any(dim=-1).all()
    _same_choice((w, ids), route_ref(logits, 4, "sigmoid", choice_bias=push, n_group=4, topk_group=2))


def test_a_hash_layer_takes_its_table(force_triton):
    force_triton("cpu")
    table = torch.stack([torch.randperm(8)[:2] for _ in range(50)])
    tokens = torch.tensor([3, 49, 0, 3, 17])
    logits = randn(5, 8, dtype=torch.float32, device="cpu", seed=6)
    with launches(_route_kernel):
        w, ids = route(logits, 2, "sqrtsoftplus", tid2eid=table, token_ids=tokens, scale=1.5)
    assert torch.equal(ids, table[tokens])
    ww, wi = route_ref(logits, 2, "sqrtsoftplus", fixed_ids=table[tokens], scale=1.5)
    torch.testing.assert_close(w, ww, atol=1e-6, rtol=1e-6)
