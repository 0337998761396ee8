"""One lockstep step of a DEP instance, per phase, and what it yields.

A DEP-N instance runs attention data-parallel (each rank its own requests) and experts
spread over the N ranks; every MoE layer's all-to-all makes the ranks wait for each
other. The step model samples `num_steps` steps; in each:

1. every rank draws its batch from the workload (decode: `batch` sequences at their
   context lengths; prefill: `batch` new tokens, chunks of requests over their cached
   prefixes);
2. attention: the slowest rank's data-parallel part (attention, shared experts, dense
   layers, LM head) for its tokens, once per layer, so the step takes the max over ranks;
3. experts: the instance's routed pairs, drawn from the skew, sent through the placement
   (naive or the project's EPLB policy with redundant slots); per MoE layer the slowest
   rank's pairs and weight reads;
4. collectives: per MoE layer the all-to-alls' latency and the dispatch and combine bytes
   of the rank that receives most, and once per step the ranks' agreement;
5. host: each rank's host time per step minus what hides behind the forward;
6. barrier: the lockstep wait for the rank whose host took longest (stalls, jitter),
   and, where ranks share too few processors (a CPU host), for a processor to run on.

Step time = 2 + 3 + 4 + 5 + 6. Any term can be switched off (Terms) to show its cost.

Glossary: pair = one (token, expert) choice; balance ratio = mean / max rank load over
the MoE layers (shared/eplb/placement.py); rank wait = what a rank spends waiting for the
others, as the engine's step accounting reports it (collectives and agreement).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moemesh.shared.plan.balance import Balance
from moemesh.shared.plan.costs import Costs
from moemesh.shared.plan.dims import ModelDims
from moemesh.shared.plan.host import HostModel
from moemesh.shared.plan.workload import Workload

TERMS = ("attention", "experts", "a2a", "host", "barrier")


@dataclass(frozen=True)
class Terms:
    """Which terms count. skew=False routes uniformly; eplb=False keeps the naive placement."""

    attention: bool = True
    experts: bool = True
    a2a: bool = True
    host: bool = True
    barrier: bool = True
    skew: bool = True
    eplb: bool = True

    @classmethod
    def without(cls, names: str) -> "Terms":
        """Terms with the comma-separated names switched off, e.g. "barrier,a2a"."""
        off = {n.strip() for n in names.split(",") if n.strip()}
        bad = off - set(TERMS) - {"skew", "eplb"}
        if bad:
            raise ValueError(f"unknown term(s) {', '.join(sorted(bad))}; terms: {', '.join(TERMS)}, skew, eplb")
        return cls(**{n: False for n in off})


@dataclass(frozen=True)
class StepConfig:
    """Args: phase "decode" or "prefill"; width N; batch: sequences per rank (decode) or
    the most new tokens a rank prefills in a step (prefill); prefill_requests: requests a
    prefill rank has at hand per step (0: its queue never empties, every step fills the
    budget); num_steps sampled; seed."""

    phase: str
    width: int
    batch: int
    prefill_requests: int = 0
    num_steps: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be decode or prefill, got {self.phase!r}")
        if self.width < 1 or self.batch < 1 or self.num_steps < 1 or self.prefill_requests < 0:
            raise ValueError("width, batch and num_steps must be >= 1, prefill_requests >= 0")


@dataclass(frozen=True)
class StepResult:
    """Means over the sampled steps, in seconds unless named otherwise."""

    phase: str
    width: int
    batch: int
    attention_s: float
    experts_s: float
    a2a_s: float
    host_s: float
    barrier_s: float
    step_s: float
    step_p90_s: float
    rank_wait_s: float
    tokens_per_rank: float  # per step
    ratio_before: float
    ratio_after: float
    seqs_per_rank: float
    ttft_s: float = 0.0  # prefill: mean time to prefill one request at this step time
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_rank / self.step_s if self.step_s > 0 else 0.0

    @property
    def tps_per_user_p90(self) -> float:
        """Decode: the rate nine users in ten get or beat (one token per step; the slow
        steps set it, hence the step time's 90th percentile)."""
        return 1.0 / self.step_p90_s if self.step_p90_s > 0 else 0.0

    def terms_s(self) -> dict[str, float]:
        return {t: getattr(self, f"{t}_s") for t in TERMS}


def run_step(cfg: StepConfig, dims: ModelDims, costs: Costs, balance: Balance, popularity, workload: Workload,
             host: HostModel, terms: Terms = Terms()) -> StepResult:
    """Samples cfg.num_steps steps of one phase at one width; see the module docstring.

    Args:
        popularity: [L, E] routing probabilities (a torch tensor); ignored if not terms.skew.
        balance: the width's placement (balance.balance()).
    """
    # Not seeded by width: two widths then share most of their sampled requests, so their
    # difference is the width's and not the draw's.
    rng = np.random.default_rng([cfg.seed, cfg.batch, cfg.phase == "decode"])
    S, N = cfg.num_steps, cfg.width
    if cfg.phase == "decode":
        tokens, seqs, attn_flops, attn_bytes = _decode_batches(cfg, dims, workload, rng)
        ttft = 0.0
    else:
        tokens, seqs, attn_flops, attn_bytes, chunks = _prefill_batches(cfg, dims, workload, rng)
    zero = np.zeros((S, N))
    attn = costs.dense_s(tokens, attn_flops, attn_bytes, N, cfg.phase) if terms.attention else zero  # [S, N]

    pop = popularity if terms.skew else _uniform_like(popularity)
    pairs, active = balance.sample(pop, tokens.sum(1) * dims.top_k, S, rng)  # [S, L', N]
    layers = dims.num_moe_layers / pairs.shape[1]  # the skew's layers stand for all MoE layers
    exp = costs.expert_s(pairs, active, float(tokens.mean()), N, cfg.phase) if terms.experts else np.zeros_like(pairs)
    a2a = costs.a2a_s(pairs.max(-1), N) if terms.a2a else np.zeros(pairs.shape[:2])  # [S, L']
    sync = costs.sync_s(N) if terms.a2a else 0.0
    comm = a2a.sum(-1) * layers + sync  # [S]

    device = attn.max(1) + exp.max(-1).sum(-1) * layers + comm  # [S]
    hostt = host.sample(seqs, device, rng) if (terms.host or terms.barrier) else zero
    own_stall, inst_stall = host.expected_stall_s(N)
    own_host = hostt.mean(1) + own_stall
    wait_host = hostt.max(1) - hostt.mean(1) + (inst_stall - own_stall)
    host_term = own_host if terms.host else np.zeros(S)
    barrier_term = wait_host if terms.barrier else np.zeros(S)
    step = device + host_term + barrier_term
    # Ranks that share too few processors (a CPU host) also wait for one to run on. The
    # collectives are not work: a rank blocked in one leaves its processor to the others.
    work = attn + exp.sum(1) * layers + (hostt if terms.host else 0.0)  # [S, N] each rank's own work
    cores = costs.core_wait_s(work, step) if terms.barrier else np.zeros(S)
    barrier_term, step = barrier_term + cores, step + cores
    # A rank waits for the slowest rank's attention and experts, for the collectives
    # themselves (the engine counts time in them as waiting) and at the barrier.
    by_rank = (attn.max(1, keepdims=True) - attn) \
        + (exp.max(-1, keepdims=True) - exp).sum(1) * layers + comm[:, None]  # [S, N]
    if terms.barrier:
        by_rank = by_rank + hostt.max(1, keepdims=True) - hostt + (inst_stall - own_stall)
        if N > 1:  # one rank that waits for a processor computes slower; it waits for no one
            by_rank = by_rank + cores[:, None]
    wait = by_rank.mean(1)
    if cfg.phase == "prefill":
        ttft = float(np.mean(chunks) * step.mean())
    return StepResult(
        phase=cfg.phase, width=N, batch=cfg.batch, attention_s=float(attn.max(1).mean()),
        experts_s=float((exp.max(-1).sum(-1) * layers).mean()), a2a_s=float(comm.mean()),
        host_s=float(host_term.mean()), barrier_s=float(barrier_term.mean()), step_s=float(step.mean()),
        step_p90_s=float(np.percentile(step, 90)), rank_wait_s=float(wait.mean()),
        tokens_per_rank=float(tokens.mean()),
        ratio_before=balance.ratio_naive if terms.skew else 1.0,
        ratio_after=(balance.ratio if terms.eplb else balance.ratio_naive) if terms.skew else 1.0,
        seqs_per_rank=float(seqs.mean()), ttft_s=ttft, extra={"rank_wait_s_by_rank": by_rank.mean(0).tolist(),
                                                     "work_s": float(work.sum(1).mean())})


def _uniform_like(popularity):
    return popularity * 0 + 1.0 / popularity.shape[1]


def _decode_batches(cfg: StepConfig, dims: ModelDims, workload: Workload, rng: np.random.Generator):
    """Each rank's `batch` sequences, each somewhere in its output: context = prompt + a
    uniform share of its output so far."""
    S, N, b = cfg.num_steps, cfg.width, cfg.batch
    new, prefix, osl = workload.sample(rng, S * N * b)
    ctx = (new + prefix + rng.random(S * N * b) * osl).reshape(S, N, b)
    flops, nbytes = dims.decode_attn(ctx)
    tokens = np.full((S, N), float(b))
    return tokens, tokens.copy(), flops.sum(-1), nbytes.sum(-1)


def _prefill_batches(cfg: StepConfig, dims: ModelDims, workload: Workload, rng: np.random.Generator):
    """Each rank prefills up to `batch` new tokens per step from its own queue: its next
    `prefill_requests` requests (or, with 0, as many as fill the budget: a queue that
    never empties). A request longer than what is left of the budget is cut; the rank's
    chunk of it is one of its chunks at random, over the cached prefix plus the chunks
    before it."""
    S, N, budget = cfg.num_steps, cfg.width, cfg.batch
    pool = 16 * S * N
    new, prefix, _ = workload.sample(rng, pool)
    chunks = np.ceil(np.maximum(new, 1) / budget)  # steps a request's prefill spans
    nxt = 0
    flops, seqs, tokens = np.zeros((S, N)), np.zeros((S, N)), np.zeros((S, N))
    for s in range(S):
        for r in range(N):
            left, taken = budget, 0
            while left > 0 and (not cfg.prefill_requests or taken < cfg.prefill_requests):
                if nxt == pool:
                    new, prefix, _ = workload.sample(rng, pool)
                    nxt = 0
                n, p = new[nxt], prefix[nxt]
                nxt += 1
                if n > left:  # one chunk of a long request, at a random place in it
                    start = rng.integers(0, int(n // left)) * left if n >= 2 * left else 0
                    p, n = p + start, left
                flops[s, r] += dims.prefill_attn_flops(n, p)
                tokens[s, r] += n
                taken += 1
                left -= n
            seqs[s, r] = taken
    return tokens, seqs, flops, np.zeros((S, N)), chunks
