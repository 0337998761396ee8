"""A stand-in model for infrastructure benchmarks (`engine = "mock"`).

It computes nothing: the logits pick a token from a hash of the position, and each step
takes a set time on the "device", so the real engine around it (scheduler, paged KV
accounting, sampling) and the whole serving path (NATS, UCX, gateway, SSE) can be
measured at high concurrency without the model's cost. Like Dynamo's mocker. It is
never the default, it is logged loudly, and /v1/models shows it.

The set time covers the whole device part of a step, as on a GPU where forward, LM head
and sampling are queued kernels and the host waits once, for the sampled ids: forward()
starts the clock and synchronize() sleeps until the step time is up. The sampler's own
CPU time therefore counts inside the step time, unless it runs longer.

Like a device stream, the mock runs queued steps back to back: a step starts when it was
queued or when the step before it is done, whichever is later (batch.queued_at). So the
device thread's own Python between two steps, which a GPU would overlap with the step
before, does not stretch the step; a host that queues late still leaves the device idle.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from moemesh.shared.model.batch import ForwardBatch
from moemesh.shared.model.config import ModelConfig


class MockModel(nn.Module):
    def __init__(self, cfg: ModelConfig, step_time_s: float):
        """cfg: any model's config (V2/V3 or V4); only its sizes and tokens are used."""
        super().__init__()
        # No MTP: the mock has no draft head, so every step emits one token per sequence.
        self.cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
        self.step_time_s = step_time_s
        self._started = 0.0
        self._late = 0.0  # how late the sleep's wake-up has been, on average
        self._free_at = 0.0  # when the step the device runs now is done

    def moe_layers(self) -> dict:
        return {}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor) -> torch.Tensor:
        now = time.perf_counter()
        queued = batch.queued_at or now
        self._started = min(now, max(queued, self._free_at))
        self._free_at = self._started + self.step_time_s
        return batch.positions.to(torch.float32)[:, None]  # [T, 1]: the "hidden state" is the position

    def synchronize(self) -> None:
        """Wait for the step's device time to be up. The sleep releases the GIL, as a
        wait for a device would. The OS wakes a sleeper late (0.1-0.2 ms on a busy VM,
        1% of a 20 ms step): the sleep is cut by how late recent wake-ups were, so that
        steps take the set time on average.

        One wake-up counts as at most a quarter step late: a process starved of CPU for a
        while wakes far later than that, and if such a stall entered the correction whole,
        later steps would be cut short. Where the host then took the rest of the shortened
        step, no sleep would run to correct it back, and the mock would run as fast as its
        host, reporting its set step time all along."""
        wake = self._started + self.step_time_s - self._late
        left = wake - time.perf_counter()
        if left > 0:
            time.sleep(left)
            late = min(time.perf_counter() - wake, self.step_time_s / 4)
            self._late = 0.9 * self._late + 0.1 * late

    def device_window(self) -> tuple[float, float]:
        """(start, end) of the last step on the mock device's clock."""
        return self._started, self._free_at

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        pos = hidden[:, 0].to(torch.long)
        # 4 + a multiplicative hash of the position: skips the special tokens, stays in vocab.
        tok = 4 + (pos * 2654435761 + 12345) % (self.cfg.vocab_size - 4)
        logits = torch.zeros(hidden.shape[0], self.cfg.vocab_size)
        logits.scatter_(1, tok[:, None], 10.0)
        return logits
