"""The plan: every DEP width for each phase, then the widths and pool sizes to deploy.

Per width the balancer places experts once (balance.py); then:
- decode: the largest batch per rank whose P90 tokens/s per user meets the target and
  whose KV cache fits beside the rank's weights, and the step at that batch;
- prefill: the step at a fixed budget of new tokens per rank.
The best width of each phase alone is the one with the most tokens/s per GPU (decode:
among those that meet the target). The pools split the GPUs into whole prefill and
decode instances, over every pair of widths, for the most requests/s the slower pool
lets through: prefill at its tokens/s over the mean new tokens per request, decode at
its tokens/s over the mean output tokens. Where the best widths do not fit together in
the GPUs (or starve one pool), the pools name other widths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moemesh.shared.plan.balance import balance
from moemesh.shared.plan.costs import Costs
from moemesh.shared.plan.dims import ModelDims
from moemesh.shared.plan.hardware import Hardware
from moemesh.shared.plan.host import HostModel
from moemesh.shared.plan.skew import Skew
from moemesh.shared.plan.step import StepConfig, StepResult, Terms, run_step
from moemesh.shared.plan.workload import Workload

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True)
class PlanConfig:
    """Args: gpus in all; widths to try (default: powers of two that divide the experts,
    up to gpus); decode_batch: fixed sequences per rank (0: the largest meeting the
    target); prefill_tokens: the most new tokens a prefill rank takes per step;
    prefill_requests: requests a prefill rank has at hand per step (0: a queue that never
    empties); target_tps_user: P90 decode
    tokens/s per user; num_redundant: EPLB's redundant slots per rank; num_steps: sampled
    steps per point; terms: which terms count; seed."""

    gpus: int
    widths: tuple[int, ...] = ()
    decode_batch: int = 0
    prefill_tokens: int = 16384
    prefill_requests: int = 0
    target_tps_user: float = 20.0
    num_redundant: int = 1
    num_steps: int = 32
    terms: Terms = field(default_factory=Terms)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.prefill_tokens < 1 or self.num_redundant < 0 or self.target_tps_user < 0:
            raise ValueError("need gpus >= 1, prefill_tokens >= 1, num_redundant >= 0, target >= 0")

    def width_list(self, num_experts: int) -> tuple[int, ...]:
        if self.widths:
            bad = [w for w in self.widths if w < 1 or num_experts % w or w > self.gpus]
            if bad:
                raise ValueError(f"widths {bad} must divide the {num_experts} experts and fit in {self.gpus} GPUs")
            return tuple(sorted(self.widths))
        return tuple(w for w in (1 << i for i in range(12)) if w <= self.gpus and num_experts % w == 0)


@dataclass(frozen=True)
class Inputs:
    """Everything one plan runs on. draft: the MTP head's skew (ratios only), or None."""

    dims: ModelDims
    costs: Costs
    hardware: Hardware | None
    workload: Workload
    host: HostModel
    target: Skew
    draft: Skew | None = None


@dataclass(frozen=True)
class Pools:
    prefill_width: int
    decode_width: int
    prefill_instances: int
    decode_instances: int
    requests_per_s: float  # what the slower pool lets through
    prefill_gpus: int
    decode_gpus: int
    prefill_requests_per_s: float = 0.0
    decode_requests_per_s: float = 0.0


@dataclass(frozen=True)
class Plan:
    prefill: list[StepResult]
    decode: list[StepResult]
    draft_ratios: dict[int, tuple[float, float]]  # width -> (before, after)
    prefill_width: int | None
    decode_width: int | None
    pools: Pools | None


def max_decode_batch(dims: ModelDims, hw: Hardware | None, width: int, num_redundant: int, mean_ctx: float) -> int:
    """Sequences a decode rank's HBM holds beside its weights (90% of HBM usable)."""
    if hw is None or not hw.hbm_bytes:
        return DECODE_BATCHES[-1]
    slots = dims.num_experts / width + (num_redundant if width > 1 else 0)
    free = 0.9 * hw.hbm_bytes - dims.weight_bytes(slots)
    return max(int(free // max(float(dims.kv_stored_bytes(mean_ctx)), 1.0)), 0)


def plan(cfg: PlanConfig, inp: Inputs) -> Plan:
    widths = cfg.width_list(inp.dims.num_experts)
    bals = {w: balance(inp.target, w, cfg.num_redundant, eplb=cfg.terms.eplb) for w in widths}
    draft = {}
    if inp.draft is not None:
        for w in widths:
            b = balance(inp.draft, w, cfg.num_redundant)
            draft[w] = (b.ratio_naive, b.ratio)
    pop = inp.target.popularity
    rng = np.random.default_rng(cfg.seed)
    new, prefix, osl = inp.workload.sample(rng, 4096)
    mean_ctx = float((new + prefix + osl / 2).mean())

    def step(phase: str, w: int, batch: int) -> StepResult:
        sc = StepConfig(phase, w, batch, prefill_requests=cfg.prefill_requests, num_steps=cfg.num_steps,
                        seed=cfg.seed)
        return run_step(sc, inp.dims, inp.costs, bals[w], pop, inp.workload, inp.host, cfg.terms)

    prefill = [step("prefill", w, cfg.prefill_tokens) for w in widths]
    decode = [_decode_at_target(cfg, inp, w, mean_ctx, lambda b, w=w: step("decode", w, b)) for w in widths]
    decode = [d for d in decode if d is not None]
    p_best = max(prefill, key=lambda r: r.tokens_per_s_per_gpu, default=None)
    meets = [d for d in decode if d.extra.get("meets_target")]
    d_best = max(meets, key=lambda r: r.tokens_per_s_per_gpu, default=None)
    mean_new, mean_osl = inp.workload.means(rng)
    pools = max((q for pr in prefill for dr in meets if (q := _pools(cfg.gpus, pr, dr, mean_new, mean_osl))),
                key=lambda q: (round(q.requests_per_s, 6), q.prefill_requests_per_s + q.decode_requests_per_s),
                default=None)  # ties: the split with more headroom
    return Plan(prefill, decode, draft, p_best.width if p_best else None, d_best.width if d_best else None, pools)


def _decode_at_target(cfg: PlanConfig, inp: Inputs, width: int, mean_ctx: float, step) -> StepResult | None:
    cap = max_decode_batch(inp.dims, inp.hardware, width, cfg.num_redundant, mean_ctx)
    if cfg.decode_batch:
        r = step(cfg.decode_batch)
        return _mark(r, cap, r.tps_per_user_p90 >= cfg.target_tps_user and cfg.decode_batch <= cap)
    # Per-user speed falls as the batch grows: bisect for the largest batch that meets it.
    sizes = [b for b in DECODE_BATCHES if b <= cap]
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        r = step(sizes[mid])
        if r.tps_per_user_p90 >= cfg.target_tps_user:
            best, lo = r, mid + 1
        else:
            hi = mid - 1
    if best is None:  # nothing meets the target: show the smallest batch, marked
        return _mark(step(1), cap, False) if cap >= 1 else None
    return _mark(best, cap, True)


def _mark(r: StepResult, cap: int, meets: bool) -> StepResult:
    r.extra.update(meets_target=meets, batch_cap=cap)
    return r


def _pools(gpus: int, p: StepResult, d: StepResult, mean_new: float, mean_osl: float) -> Pools | None:
    """The best split of `gpus` into whole instances of these two widths, or None."""
    best = None
    for n_p in range(1, gpus // p.width + 1):
        n_d = (gpus - n_p * p.width) // d.width
        if n_d < 1:
            break
        pre = n_p * p.width * p.tokens_per_s_per_gpu / mean_new
        dec = n_d * d.width * d.tokens_per_s_per_gpu / mean_osl
        if best is None or min(pre, dec) > best.requests_per_s:
            best = Pools(p.width, d.width, n_p, n_d, min(pre, dec), n_p * p.width, n_d * d.width, pre, dec)
    return best
