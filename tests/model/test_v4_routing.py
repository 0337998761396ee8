"""DeepSeek-V4 routing by its definition: learned top-k on score + bias, or the hash table;
weights are the chosen scores, normalised (norm_topk_prob), times routed_scaling_factor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.v4.moe import HashRouter, V4Router


def _cfg(**kw):
    return ModelConfig.from_dict(preset_config("v4-tiny") | kw)


def _fill(router, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.3 * torch.randn(router.weight.shape[0], generator=g))
    return router


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("norm", [True, False])
def test_learned_routing(scoring, norm):
    cfg = _cfg(scoring_func=scoring, norm_topk_prob=norm, routed_scaling_factor=2.5)
    r = _fill(V4Router(cfg))
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    weights, ids = r(x, torch.zeros(9, dtype=torch.long))
    logits = x @ r.weight.T
    score = {"sqrtsoftplus": F.softplus(logits).sqrt(), "sigmoid": logits.sigmoid(),
             "softmax": logits.softmax(-1)}[scoring]
    for t in range(9):
        want = (score[t] + r.e_score_correction_bias).topk(cfg.num_experts_per_tok).indices
        assert set(ids[t].tolist()) == set(want.tolist())
        w = score[t, ids[t]]
        if norm:
            w = w / w.sum()
        torch.testing.assert_close(weights[t], w * 2.5)


def test_hash_routing_takes_the_table_and_the_learned_scores():
    cfg = _cfg()
    r = _fill(HashRouter(cfg))
    table = torch.randint(0, cfg.n_routed_experts, (cfg.vocab_size, cfg.num_experts_per_tok),
                          generator=torch.Generator().manual_seed(2))
    r.tid2eid.copy_(table)
    x = torch.randn(5, cfg.hidden_size)
    ids_in = torch.tensor([3, 3, 17, 900, 4])
    weights, ids = r(x, ids_in)
    assert torch.equal(ids, table[ids_in])
    score = F.softplus(x @ r.weight.T).sqrt().gather(1, ids)
    torch.testing.assert_close(weights, score / score.sum(-1, keepdim=True) * cfg.routed_scaling_factor)
    assert not hasattr(r, "e_score_correction_bias")
