"""The load tracker's window while the device thread routes the next step: a step's
counts are closed once, and what is routed after the close belongs to the next step."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from moemesh.shared.engine.load_tracker import LoadTracker


class _Layer:
    on_route = None


def _tracker(window_steps: int) -> LoadTracker:
    layers = {0: _Layer(), 1: _Layer()}
    model = SimpleNamespace(moe_layers=lambda: layers, cfg=SimpleNamespace(num_hidden_layers=1, n_routed_experts=8))
    return LoadTracker(model, window_steps)


def test_routing_beside_the_step_close_never_drives_the_window_negative():
    """The engine loop closes step N (end_step) while the device thread already routes
    step N+1 into the tracker. A count added to a step after it was summed into the
    window, and subtracted whole when it leaves, would leave the window short: negative
    loads, which the balancer refuses. Whatever the interleaving, once routing stops and
    every step has left the window, the window is zero, and until then never negative."""
    tr = _tracker(window_steps=2)
    ids = torch.tensor([[0, 3], [5, 3]])
    stop = threading.Event()
    routed = [0]

    def device() -> None:
        while not stop.is_set() and routed[0] < 200_000:
            tr._on_route(0, ids)
            tr._on_route(1, ids)
            routed[0] += 1

    t = threading.Thread(target=device)
    t.start()
    negative = False
    try:
        for _ in range(3_000):
            tr.end_step()
            negative |= bool((tr.window() < 0).any())
    finally:
        stop.set()
        t.join(30)
    for _ in range(tr.window_steps + 1):  # the last routed counts close, then every step leaves
        tr.end_step()
    assert not negative
    assert int(tr.window().abs().sum()) == 0
    assert tr.total_steps == 3_000 + tr.window_steps + 1


def test_a_closed_step_holds_what_was_routed_before_its_close():
    tr = _tracker(window_steps=4)
    tr._on_route(0, torch.tensor([[1, 2]]))
    tr.end_step()
    tr._on_route(0, torch.tensor([[2, 2]]))
    assert tr.window()[0].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    tr.end_step()
    assert tr.window()[0].tolist() == [0, 1, 3, 0, 0, 0, 0, 0]
