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
    def __init__(self, cfg: ModelConfig, step_time_s: float, accept_rate: float | None = None):
        """cfg: any model's config (V2/V3 or V4); only its sizes and tokens are used.
        accept_rate: None, no draft head (one token per sequence a step); else it has one,
        whose every draft the target accepts with this probability (see mtp_logits)."""
        super().__init__()
        self.cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0 if accept_rate is None else 1)
        self.accept_rate = accept_rate
        self.wants_row_keys = accept_rate is not None  # drafts are decided per (request, position)
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
        return self._hidden(batch, 0)

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
        return self._logits(self._token(hidden[:, 0].to(torch.long)))

    # ---- the draft head (accept_rate set) ------------------------------------------------
    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, kv_caches) -> torch.Tensor:
        """A row at position p drafts the token the target emits from position p + 1:
        its "hidden state" is that position. Device time: inside the step's."""
        return self._hidden(batch, 1)

    @torch.inference_mode()
    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's token, or for a rejected draft the next one: the draft for position
        p of request r is right when a hash of (r, p), as a fraction, is below accept_rate.
        The engine's verification decides what is accepted, as for a real draft head; a
        step's drafts are accepted in order, so a sequence gains A + A^2 + ... + A^K."""
        pos, key = hidden[:, 0].to(torch.long), hidden[:, 1].to(torch.long)
        tok = self._token(pos)
        u = _unit_hash(key, pos)
        wrong = 4 + (tok - 4 + 1) % (self.cfg.vocab_size - 4)
        return self._logits(torch.where(u < self.accept_rate, tok, wrong))

    def _hidden(self, batch: ForwardBatch, ahead: int) -> torch.Tensor:
        """[T, 2]: (position + ahead, the row's request key), all the mock computes from;
        without a draft head, [T, 1]: the position alone."""
        pos = batch.positions + ahead if ahead else batch.positions
        if batch.row_keys is None:
            return pos.to(torch.float64)[:, None]
        return torch.stack([pos, batch.row_keys], dim=1).to(torch.float64)

    def _token(self, pos: torch.Tensor) -> torch.Tensor:
        """4 + a multiplicative hash of the position: skips the special tokens, stays in vocab."""
        return 4 + (pos * 2654435761 + 12345) % (self.cfg.vocab_size - 4)

    def _logits(self, tok: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(tok.shape[0], self.cfg.vocab_size)
        logits.scatter_(1, tok[:, None], 10.0)
        return logits


def _unit_hash(key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A fraction in [0, 1) per (key, position), mixed so that neighbouring positions are
    unrelated: each draft's fate is its own, whichever positions a sequence's earlier
    acceptances make it draft at."""
    x = (key & 0xFFFFFFFF) * 0x9E3779B1 + pos * 0x632BE5AB + 0x1B873593
    for shift, mul in ((16, 0x45D9F3B), (16, 0x45D9F3B), (16, 1)):
        x = ((x ^ (x >> shift)) * mul) & 0xFFFFFFFF
    return x.to(torch.float64) / 2**32
