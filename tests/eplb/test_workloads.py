import torch

from moemesh.shared.eplb.placement import naive_placement
from moemesh.shared.eplb.workloads import HOT, ZIPF


def test_windows_are_seeded_and_sum_to_routed_tokens():
    a, b = ZIPF.windows(2), ZIPF.windows(2)
    assert torch.equal(a, b)
    assert bool((a.sum(-1) == ZIPF.tokens_per_window * ZIPF.top_k).all())
    assert not torch.equal(a[0], a[1])


def test_hot_experts_sit_at_random_ids_and_respect_the_top_k_cap():
    p = HOT.popularity()
    assert float(p.max()) < 1 / HOT.top_k  # a token picks top_k distinct experts
    hot = p.topk(HOT.num_hot, dim=1).values.sum(1)
    assert torch.allclose(hot, torch.full_like(hot, HOT.hot_share))
    where = p.argmax(1)
    assert len(set(where.tolist())) > 10  # the hottest expert's id differs layer to layer


def test_naive_ratios_are_calibrated():
    naive = naive_placement(43, 256, 32, 1)
    assert abs(naive.instance_ratio(ZIPF.windows(1)[0]) - 0.35) < 0.03
    assert abs(naive.instance_ratio(HOT.windows(1)[0]) - 0.21) < 0.02
