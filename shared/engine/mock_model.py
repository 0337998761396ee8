"""A stand-in model for infrastructure benchmarks (`engine = "mock"`).

It computes nothing: each forward sleeps for a set step time and the logits pick a
token from a hash of the position, so the real engine around it (scheduler, paged
KV accounting, sampling) and the whole serving path (NATS, UCX, gateway, SSE) can be
measured at high concurrency without the model's cost. Like Dynamo's mocker. It is
never the default, it is logged loudly, and /v1/models shows it.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from shared.model.batch import ForwardBatch
from shared.model.config import ModelConfig
from shared.model.rope import RotaryEmbedding


class MockModel(nn.Module):
    def __init__(self, cfg: ModelConfig, step_time_s: float):
        super().__init__()
        # No MTP: the mock has no draft head, so every step emits one token per sequence.
        self.cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
        self.step_time_s = step_time_s
        self.rope = RotaryEmbedding(self.cfg)
        self._positions = torch.zeros(0, dtype=torch.long)

    def moe_layers(self) -> dict:
        return {}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor) -> torch.Tensor:
        if self.step_time_s > 0:
            time.sleep(self.step_time_s)  # releases the GIL, as a real forward on a device would
        self._positions = batch.positions
        return batch.positions.to(torch.float32)[:, None]  # [T, 1]: the "hidden state" is the position

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        pos = hidden[:, 0].to(torch.long)
        # 4 + a multiplicative hash of the position: skips the special tokens, stays in vocab.
        tok = 4 + (pos * 2654435761 + 12345) % (self.cfg.vocab_size - 4)
        logits = torch.zeros(hidden.shape[0], self.cfg.vocab_size)
        logits.scatter_(1, tok[:, None], 10.0)
        return logits
