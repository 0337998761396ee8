"""Which of two placements should serve the NEXT window, layer by layer.

A placement is built on one window of loads and then serves the next one, which differs:

- sampling: a window's count of expert e is a multinomial draw, so the observed count
  w_e and the next window's each miss the expert's popularity by about sqrt(w_e):
  between them, variance about 2 w_e;
- drift: the traffic mix moves between windows; workloads.py makes it a step of std d
  in log popularity, variance about (d w_e)^2. d is what the balancer's load statistics
  should estimate (how much an expert's load changes from one window to the next beyond
  sampling); 0.05 is the calibrated workloads' value.

Balancing the observed window past ~0.999 fits the sampling noise, which the next
window does not repeat, and the next window's max rank load depends on every rank's
spread, not only on the heaviest rank: a rank of a few heavy slots varies more than one
of many light ones, and the replicas of one expert rise and fall together on all their
ranks. So candidates are scored by Monte Carlo: M perturbed copies of the loads, the
same copies for every candidate (common random numbers, so that differences between
candidates are far more precise than the values), and each candidate's max rank load
under each copy. Only max matters: every candidate has the same mean rank load under
a given copy, and the instance ratio is sum of means over sum of maxes.

The choice is risk-averse. DeepSeek's placement is the default; ours replaces it in
the layers where it gains most per unit of spread (expected gain over the std across
copies), as many of them as maximise the instance's expected gain less `caution`
standard deviations of it. A placement serves one real next window, not the mean of
many: a layer whose expected gain is small against its spread is as likely a loss, and
a few clear gains (replica counts that pack, on hot experts) let doubtful ones ride
along only while their sum stays clearly positive. The copies also carry the model's
own error: held out on the grid, the real spread of a layer's gain was ~30% above the
copies' (docs/eplb.md).

The loads must be token counts (the sampling term reads them as such). Scaling them
only shifts the weight between the sampling and the drift terms.

Shapes: M = samples, L = layers, E = experts, R = ranks, P = slots per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NextWindow:
    """How the next window is expected to differ from the observed one, and how to choose.

    Args:
        drift: d, the relative std of an expert's load change between windows beyond
            sampling (log-popularity step).
        num_samples: M, Monte Carlo copies of the next window.
        caution: standard deviations of the instance's gain (over copies) that its
            expected gain must clear: the choice maximises mean - caution * std.
        seed: of the copies; fixed, so equal loads give equal placements.
    """

    drift: float = 0.05
    num_samples: int = 64
    caution: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.drift < 0 or self.num_samples < 2 or self.caution < 0:
            raise ValueError("need drift >= 0, num_samples >= 2, caution >= 0")


def sample_next(loads: torch.Tensor, model: NextWindow) -> torch.Tensor:
    """[M, L, E] float32: copies of loads [L, E] as the next window might bring them."""
    w = loads.float()
    g = torch.Generator().manual_seed(model.seed)
    z = torch.randn((model.num_samples, *w.shape), generator=g, dtype=torch.float32)
    std = (2 * w + (model.drift * w) ** 2).sqrt()
    return z.mul_(std).add_(w).clamp_min_(0)


def peak_loads(samples: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[M, L] max rank load of the placement phy2log [L, P] under each copy [M, L, E]."""
    num_samples, num_layers, num_experts = samples.shape
    counts = torch.zeros(num_layers, num_experts, dtype=samples.dtype)
    counts.scatter_add_(1, phy2log, torch.ones_like(phy2log, dtype=samples.dtype))
    slots = samples.gather(2, phy2log.expand(num_samples, -1, -1)).div_(counts.gather(1, phy2log))  # [M, L, P]
    return slots.view(num_samples, num_layers, num_ranks, -1).sum(-1).amax(-1)


def better_layers(loads: torch.Tensor, default: torch.Tensor, alternative: torch.Tensor, num_ranks: int,
                  model: NextWindow = NextWindow()) -> torch.Tensor:
    """[L] bool: the layers that should take `alternative` rather than `default`.

    Args:
        loads: [L, E] the observed window's token counts.
        default, alternative: [L, P] two placements' phy2log.
        num_ranks: R.
        model: the next window's model and the caution of the choice.
    """
    samples = sample_next(loads, model)
    gain = (peak_loads(samples, default, num_ranks) - peak_loads(samples, alternative, num_ranks)).double()  # [M, L]
    mean, spread = gain.mean(0), gain.std(0)
    merit = torch.where(spread > 0, mean / spread.clamp_min(1e-30), torch.zeros_like(mean))  # [L]
    order = merit.argsort(descending=True)
    total = gain[:, order].cumsum(1)  # [M, L] the instance's gain taking the first k+1 layers
    score = total.mean(0) - model.caution * total.std(0)
    score = score.masked_fill(merit[order] <= 0, -torch.inf)  # never a layer expected to lose
    take = torch.zeros_like(mean, dtype=torch.bool)
    if bool((score > 0).any()):
        take[order[:int(score.argmax()) + 1]] = True
    return take
