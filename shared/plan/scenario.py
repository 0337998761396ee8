"""`moemesh plan --scenario seed`: the seed's findings, run through the step model.

The seed reported, without the setup behind them:
1. DEP4 prefill delivered 83% of DEP2's per-GPU throughput (ranks fell out of step);
2. an unoptimized DEP32 decode ran slower than DEP16 despite faster GPU execution
   (shorter synchronized steps exposed host overhead and rank skew);
3. EPLB raised the balance ratio from 0.35 to 0.94 (target) and from 0.21 to 0.89 (draft).

The scenario fills in what the seed left out with the assumptions below (ASSUMPTIONS,
printed with the result) and checks each finding against a band:
1. prefill DEP4 / DEP2 tokens/s per GPU in [0.78, 0.88] on the agentic mix;
2. decode DEP32 below DEP16 per GPU with the host measured before issue 9, above it
   with the host measured after;
3. naive ratios within 0.05 of 0.35 and 0.21 at skews that match, ours at or above
   0.94 and 0.89.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moemesh.shared.checkpoint.presets import preset_config
from moemesh.shared.plan import skew as skews
from moemesh.shared.plan.balance import balance
from moemesh.shared.plan.costs import Roofline
from moemesh.shared.plan.dims import from_config
from moemesh.shared.plan.hardware import get_hardware
from moemesh.shared.plan.host import HOSTS
from moemesh.shared.plan.step import StepConfig, run_step
from moemesh.shared.plan.workload import WORKLOADS


@dataclass(frozen=True)
class SeedAssumptions:
    """What the seed did not say, as the scenario takes it."""

    model: str = "v4-flash"
    hardware: str = "gb200-nvl72"
    workload: str = "agentic"
    target_skew: str = "zipf:0.69"  # naive 0.335 at 256 experts / 32 ranks (docs/eplb.md)
    draft_skew: str = "hot:4:0.42"  # naive 0.204 there
    num_redundant: int = 1
    prefill_tokens: int = 16384
    prefill_requests: int = 2
    decode_batch: int = 64
    host_before: str = "before-9"
    host_after: str = "after-9"
    ratio_width: int = 32
    num_steps: int = 256
    seed: int = 0


ASSUMPTIONS = (
    "V4-Flash dimensions (moemesh init-model preset v4-flash); experts FP4, other weights FP8, KV FP8",
    "GB200 NVL72: DEP16 and DEP32 both inside one NVLink domain, so DEP32's GPU time per step is "
    "shorter (half the expert weights to read per rank)",
    "kernels reach 60% of dense FP8/BF16 peak and 75% of HBM bandwidth; all-to-all 90% of the link",
    "agentic mix: contexts lognormal(32k, 0.8) up to 128k, 8 turns a session, later turns prefill "
    "256-4096 new tokens over the cached rest",
    "prefill: each rank takes the next two requests of its own queue per step, chunked at 16,384 "
    "tokens (the ranks are not fed in step: what one rank prefills says nothing of the others)",
    "decode: 64 sequences per rank at both widths, no MTP drafts in the step",
    "target skew zipf:0.69 and draft skew hot:4:0.42, the calibrated workloads of docs/eplb.md; "
    "one redundant slot per rank; placements built on one window and scored on the next",
    "host before issue 9: 5 ms per step, not overlapped, a 50 ms stall every 300 steps per rank; "
    "after: 0.27 ms + 4.5 us per sequence, 93% overlapped, no stalls (docs/benchmarks.md)",
)


def run_seed(a: SeedAssumptions = SeedAssumptions()) -> dict:
    """Runs the three findings; returns every figure and whether each band holds."""
    dims = from_config(preset_config(a.model), name=a.model)
    costs = Roofline(dims, get_hardware(a.hardware))
    work = WORKLOADS[a.workload]
    target = skews.parse(a.target_skew, dims.num_moe_layers, dims.num_experts, dims.top_k, seed=a.seed)
    draft = skews.parse(a.draft_skew, 1, dims.num_experts, dims.top_k, seed=a.seed)
    pop = target.popularity

    def step(phase, width, batch, host):
        bal = balance(target, width, a.num_redundant)
        cfg = StepConfig(phase, width, batch, prefill_requests=a.prefill_requests, num_steps=a.num_steps,
                         seed=a.seed)
        return run_step(cfg, dims, costs, bal, pop, work, HOSTS[host])

    p2, p4 = (step("prefill", w, a.prefill_tokens, a.host_after) for w in (2, 4))
    prefill_ratio = p4.tokens_per_s_per_gpu / p2.tokens_per_s_per_gpu
    decode = {h: {w: step("decode", w, a.decode_batch, h) for w in (16, 32)} for h in (a.host_before, a.host_after)}
    tb = balance(target, a.ratio_width, a.num_redundant)
    db = balance(draft, a.ratio_width, a.num_redundant)

    def gpu(h, w):
        return decode[h][w].tokens_per_s_per_gpu

    checks = {
        "prefill_dep4_over_dep2": {"value": prefill_ratio, "band": [0.78, 0.88],
                                   "holds": 0.78 <= prefill_ratio <= 0.88},
        "decode_dep32_below_dep16_before": {"value": gpu(a.host_before, 32) / gpu(a.host_before, 16),
                                            "band": ["< 1"], "holds": gpu(a.host_before, 32) < gpu(a.host_before, 16)},
        "decode_dep32_above_dep16_after": {"value": gpu(a.host_after, 32) / gpu(a.host_after, 16),
                                           "band": ["> 1"], "holds": gpu(a.host_after, 32) > gpu(a.host_after, 16)},
        "target_ratio_naive": {"value": tb.ratio_naive, "band": [0.30, 0.40],
                               "holds": abs(tb.ratio_naive - 0.35) <= 0.05},
        "draft_ratio_naive": {"value": db.ratio_naive, "band": [0.16, 0.26],
                              "holds": abs(db.ratio_naive - 0.21) <= 0.05},
        "target_ratio_eplb": {"value": tb.ratio, "band": [">= 0.94"], "holds": tb.ratio >= 0.94},
        "draft_ratio_eplb": {"value": db.ratio, "band": [">= 0.89"], "holds": db.ratio >= 0.89},
    }
    return {"scenario": "seed", "assumptions": list(ASSUMPTIONS), "config": a.__dict__, "checks": checks,
            "prefill": {w: r for w, r in ((2, p2), (4, p4))}, "decode": decode,
            "all_hold": all(c["holds"] for c in checks.values())}


def with_overrides(**kw) -> SeedAssumptions:
    return replace(SeedAssumptions(), **{k: v for k, v in kw.items() if v is not None})
