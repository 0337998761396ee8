"""The mock engine's step clock (shared/engine/mock_model.py)."""

from __future__ import annotations

import time
from time import sleep as host_sleep  # not patched below

import torch

from moemesh.shared.engine import mock_model
from moemesh.shared.engine.mock_model import MockModel
from moemesh.shared.model.config import ModelConfig


class _Batch:
    queued_at = 0.0
    positions = torch.zeros(1, dtype=torch.long)


def _step(model: MockModel, host_s: float = 0.0) -> float:
    t = time.perf_counter()
    model(_Batch(), None)
    host_sleep(host_s)  # the host's work inside the step (sampling, output processing)
    model.synchronize()
    return time.perf_counter() - t


def test_a_stalled_wake_up_does_not_shorten_the_steps_after_it(tiny_model, monkeypatch):
    step_s = 0.02
    model = MockModel(ModelConfig.from_dir(tiny_model), step_s)
    real_sleep = time.sleep
    # One wake-up 200 ms late, as when the process is starved of CPU for a while.
    stalls = iter([0.2])
    monkeypatch.setattr(mock_model.time, "sleep", lambda s: real_sleep(s + next(stalls, 0.0)))
    _step(model)
    # Then steps whose host work takes most of the step: without a bound on the
    # correction these took the host's 12 ms, not the set 20.
    took = [_step(model, host_s=0.012) for _ in range(10)]
    assert min(took) > 0.7 * step_s, took
