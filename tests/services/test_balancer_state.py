"""The balancer's view of an instance: the placement and its version stay what the
ranks hold while moves run back to back."""

from __future__ import annotations

import msgpack
import pytest
import torch

from moemesh.services.balancer.state import InstanceView
from moemesh.shared.model.expert_parallel import start_phy2log
from moemesh.shared.protocol.messages import ExpertLoad, ProtocolError, decode, encode
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


def test_a_report_of_the_wrong_shape_is_refused_on_arrival_and_negative_counts_are_ignored():
    naive = start_phy2log(E, R, 1).repeat(LAYERS, 1)
    good = _report(0, naive)
    for field, value, words in (("counts", good.counts[:-8], "counts is"),
                                ("phy2log", good.phy2log[:-8], "phy2log is"),
                                ("rank", 2, "rank 2 is not in")):
        raw = msgpack.unpackb(encode(good))
        raw[field] = value
        with pytest.raises(ProtocolError, match=words):
            decode(msgpack.packb(raw), ExpertLoad)
    view = InstanceView.from_load(good)
    view.observe(good)
    negative = torch.ones(LAYERS, E, dtype=torch.long)
    negative[1, 3] = -4
    report = _report(0, naive)
    report.counts = tensor_bytes(negative)
    with pytest.raises(ValueError, match="negative expert counts"):
        view.observe(report)
    assert int(view.loads().min()) == 1  # the rank's last good report stands
