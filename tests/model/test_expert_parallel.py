"""Dispatch to replicas: each expert's pairs are dealt round-robin over its slots."""

from __future__ import annotations

import torch

from moemesh.shared.model.expert_parallel import log2phy_of, to_replicas

# 8 experts over 2 ranks, 5 slots each: expert 3 has a replica on each rank (slots 3, 9).
PHY2LOG = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 3])


def _slot_counts(batches: list[torch.Tensor], rank: int = 0) -> torch.Tensor:
    log2phy, counts = log2phy_of(PHY2LOG, 8, 2)
    turn = torch.full((8,), rank, dtype=torch.long)
    out = torch.zeros(PHY2LOG.numel(), dtype=torch.long)
    for ids in batches:
        phy = to_replicas(ids.reshape(-1), log2phy, counts, turn)
        assert bool((PHY2LOG[phy] == ids.reshape(-1)).all())  # every pair reaches its own expert
        out += torch.bincount(phy, minlength=PHY2LOG.numel())
    return out


def test_a_hash_hot_expert_in_one_column_is_split_evenly():
    """Hash routing fixes each token's experts and their order: here expert 3 is always
    the second choice, so every pair of it has an odd index in the flat batch. A pick by
    that index would send all of them to one replica."""
    g = torch.Generator().manual_seed(0)
    first = torch.tensor([0, 1, 2, 4, 5, 6, 7])[torch.randint(0, 7, (101,), generator=g)]
    ids = torch.stack([first, torch.full_like(first, 3)], dim=1)  # [T, K]
    c = _slot_counts([ids])
    assert c[3] + c[9] == 101 and abs(int(c[3] - c[9])) <= 1
    assert c[0] + c[8] == int((first == 0).sum()) and abs(int(c[0] - c[8])) <= 1


def test_the_deal_carries_across_steps_of_one_token():
    """Decode steps of one token each still alternate between the replicas."""
    steps = [torch.tensor([[5, 3]]) for _ in range(10)]
    for rank in (0, 1):
        c = _slot_counts(steps, rank)
        assert (int(c[3]), int(c[9])) == (5, 5)
        assert int(c[5]) == 10  # one replica: every pair


def test_with_one_replica_each_the_lookup_deals_as_the_round_robin_does():
    phy2log = torch.tensor([4, 0, 7, 1, 3, 2, 6, 5])  # 8 experts, 2 ranks, no replicas
    log2phy, counts = log2phy_of(phy2log, 8, 2)
    g = torch.Generator().manual_seed(1)
    dealt, looked_up = torch.full((8,), 1), torch.full((8,), 1)
    for _ in range(3):
        flat = torch.randint(0, 8, (40,), generator=g)
        want = to_replicas(flat, log2phy, counts, dealt)
        assert to_replicas(flat, log2phy, counts, looked_up, one_each=True).tolist() == want.tolist()
        assert looked_up.tolist() == dealt.tolist()


def test_what_a_step_reads_lives_on_the_experts_device():
    """On a GPU the routed ids, the receive buffers and NCCL's all-to-alls are on the device,
    so the deal's tables must be too; the placement itself stays on the host for the
    balancer. Checked on torch's meta device, which rejects a host operand as CUDA does."""
    from moemesh.shared.model.expert_parallel import EPLayer
    from moemesh.shared.model.moe import Experts

    meta = torch.device("meta")
    layer = EPLayer(Experts(5, 4, 2).to(meta), PHY2LOG, 8, rank=0, world=2)
    assert {t.device for t in (layer.log2phy, layer.counts, layer.turn, layer.slot_tokens)} == {meta}
    assert layer.phy2log.device.type == "cpu" and not layer.one_each
    layer.set_placement(torch.arange(10) % 8)  # a move: the new tables go where the old were
    assert layer.log2phy.device == layer.counts.device == meta and not layer.one_each
    one_each = EPLayer(Experts(4, 4, 2).to(meta), torch.arange(8), 8, rank=1, world=2)
    assert one_each.one_each and to_replicas(torch.tensor([3, 5]).to(meta), one_each.log2phy, one_each.counts,
                                             one_each.turn, True).device == meta
