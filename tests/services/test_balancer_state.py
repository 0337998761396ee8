"""The balancer's view of an instance: the placement and its version stay what the
ranks hold while moves run back to back."""

from __future__ import annotations

import torch

from moemesh.services.balancer.state import InstanceView
from moemesh.shared.model.expert_parallel import start_phy2log
from moemesh.shared.protocol.messages import ExpertLoad
from moemesh.shared.service.dep_runtime import tensor_bytes

LAYERS, E, R = 3, 8, 2


def _report(version: int, phy2log: torch.Tensor) -> ExpertLoad:
    counts = torch.ones(LAYERS, E, dtype=torch.long)
    return ExpertLoad("i", 0, R, 10, 8, list(range(LAYERS)), LAYERS - 1, E, tensor_bytes(counts),
                      phy2log.shape[1] // R, version, tensor_bytes(phy2log))


def test_a_report_during_a_move_does_not_change_the_placement():
    naive = start_phy2log(E, R, 1).repeat(LAYERS, 1)
    moved = naive.flip(1).contiguous()
    view = InstanceView.from_load(_report(0, naive))
    view.observe(_report(0, naive))
    assert view.version == 0
    view.moving = True
    view.observe(_report(1, moved))  # the ranks switched; the balancer has not heard it yet
    assert view.version == 0 and torch.equal(view.phy2log, naive)
    view.moving = False
    view.observe(_report(1, moved))
    assert view.version == 1 and torch.equal(view.phy2log, moved)
