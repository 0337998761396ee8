"""Seeded synthetic expert loads, in consecutive windows, for judging placements held out.

Each layer has its own expert popularity p [E] (summing to 1), shuffled by a random
permutation because real hot experts sit at scattered ids. A window is a multinomial
sample of tokens_per_window * top_k routed tokens from p. Between windows, log p takes
a Gaussian random-walk step of scale `drift` (then renormalised), which stands for the
traffic mix changing; windows are therefore correlated, like successive real ones.

The multinomial draws routed tokens independently; a real token picks top_k distinct
experts, which caps an expert at tokens_per_window. Every generator keeps every
expert's share below 1/top_k, so that cap never binds and the sample is faithful in the
mean; its variance is a little higher than the real one.

Two calibrated kinds (docs/eplb.md lists their naive ratios at 256 experts, 32 ranks):
- "zipf": p_i ~ i^-s for popularity rank i, s = 0.69: naive ratio about 0.35.
- "hot": 4 hot experts share 42% of routed tokens (split among them as Zipf(0.2): 12.2,
  10.7, 9.8 and 9.3%), the rest Zipf(0.25) over the other experts, like an MTP draft
  layer: naive ratio about 0.21.

Window size and drift (64k tokens, 5% per window) are what makes held-out scores
differ from in-window ones; they were set so DeepSeek's EPLB lands where it was
measured on real traffic held out: 0.92-0.96 on Zipf, 0.87-0.89 on hot experts.

Shapes: W = windows, L = layers, E = experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Workload:
    """One synthetic traffic pattern; `windows()` samples it.

    Args:
        kind: "zipf" or "hot".
        num_layers: L MoE layers (DeepSeek-V3 has 58, the 43 here is a wide-EP slice).
        num_experts: E routed experts per layer.
        tokens_per_window: tokens (not routed tokens) in one load window.
        top_k: experts per token; a window holds tokens_per_window * top_k routed tokens.
        zipf_exponent: s of the Zipf popularity (of the cold experts, for "hot").
        num_hot: hot experts, "hot" only.
        hot_share: fraction of routed tokens the hot experts carry together, "hot" only.
        hot_exponent: the hot experts split hot_share among themselves as Zipf(this).
        drift: std of the per-window random-walk step in log popularity.
        seed: everything random derives from it.
    """

    kind: str = "zipf"
    num_layers: int = 43
    num_experts: int = 256
    tokens_per_window: int = 65536
    top_k: int = 8
    zipf_exponent: float = 0.69
    num_hot: int = 4
    hot_share: float = 0.42
    hot_exponent: float = 0.2
    drift: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("zipf", "hot"):
            raise ValueError(f"unknown workload kind {self.kind!r}")
        if self.kind == "hot" and not 0 < self.num_hot < self.num_experts:
            raise ValueError("num_hot must be between 1 and num_experts - 1")
        if not 0 < self.hot_share < 1 or self.drift < 0 or self.tokens_per_window <= 0:
            raise ValueError("need 0 < hot_share < 1, drift >= 0, tokens_per_window > 0")

    def popularity(self) -> torch.Tensor:
        """[L, E] float64: the first window's expert probabilities."""
        rng = self._rng(0)
        if self.kind == "zipf":
            base = _zipf(self.num_experts, self.zipf_exponent)
        else:
            cold = _zipf(self.num_experts - self.num_hot, self.zipf_exponent) * (1 - self.hot_share)
            hot = _zipf(self.num_hot, self.hot_exponent) * self.hot_share
            base = np.concatenate([hot, cold])
        perms = np.argsort(rng.random((self.num_layers, self.num_experts)), axis=1)
        return torch.from_numpy(base[perms])

    def windows(self, num_windows: int) -> torch.Tensor:
        """[W, L, E] int64: routed-token counts of consecutive windows."""
        rng = self._rng(1)
        logp = self.popularity().log().numpy()
        routed = self.tokens_per_window * self.top_k
        out = np.empty((num_windows, self.num_layers, self.num_experts), dtype=np.int64)
        for w in range(num_windows):
            if w:
                logp = logp + self.drift * rng.standard_normal(logp.shape)
            p = np.exp(logp - logp.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[w] = rng.multinomial(routed, p)
        return torch.from_numpy(out)

    def _rng(self, stream: int) -> np.random.Generator:
        # Separate streams keep the permutation fixed when only the window count changes.
        return np.random.default_rng([self.seed, stream])


def _zipf(n: int, exponent: float) -> np.ndarray:
    weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


ZIPF = Workload(kind="zipf")
HOT = Workload(kind="hot", zipf_exponent=0.25)
