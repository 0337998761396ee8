"""What a training run does (`moemesh init-model --train`); no torch here, so the CLI
can offer the defaults without importing it."""

from __future__ import annotations

from dataclasses import dataclass


# Optimizer steps when none are given: what fits in 15 minutes on 2 cores. v4-tiny's
# step (hyper-connections, compressed attention) takes about 0.61 s to the V3 tiny's
# 0.27 s, and its held-out loss is flat from about step 1,100 of 1,500 (docs/eplb.md).
DEFAULT_STEPS = {"v4-tiny": 1200}


def default_steps(preset: str) -> int:
    return DEFAULT_STEPS.get(preset, TrainConfig.steps)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    mtp_weight: float = 0.3  # DeepSeek-V3's weight of the MTP loss, early in training
    bias_rate: float = 1e-3  # DeepSeek-V3's correction-bias update speed
    corpus_mb: float = 4.0
    held_out: float = 0.02
    eval_every: int = 100
    eval_batches: int = 4
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch", "seq_len", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train {name.replace('_', '-')} must be at least 1")
        if self.seq_len < 8:
            raise ValueError("train seq-len must be at least 8")
        if not self.lr > 0:
            raise ValueError("train lr must be positive")
