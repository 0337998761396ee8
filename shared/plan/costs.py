"""How long a rank's work takes: the seam between the step model and a machine.

Two kinds of machine plug in:
- Roofline: a GPU from the hardware table. Each part takes the longer of its FLOPs at the
  reached compute rate and its bytes at the reached memory rate.
- Measured: this host, from `bench forward`'s step times of the same model at DEP1.
  The forward at batch b is split into its data-parallel part and its expert part,
  either by the expert kernel's own measured cost (a fixed cost per expert slot that
  runs, plus a cost per pair: `slot_s`, `pair_s`) or, without it, by FLOP shares; a rank
  of a wider instance then takes the dense part at its own batch and the expert part
  for the slots and pairs it runs, at the speed a rank computes in the mesh (`speed`,
  against the calibration's). Between the ranks, every collective is a wait of its own,
  timed on this host at each width (`collective_s_by_width`, `agree_s_by_width`): during
  it the rank's processor is free for the others, so it lengthens the rank's step
  without taking CPU from anyone. Where the ranks share fewer processors than there are
  ranks, a step cannot be shorter than all the ranks' CPU work over the processors left
  to them (core_wait_s): a separate lower bound, and the step is the longer of the two.

  Why latency adds along a rank's path and is kept out of the processor bound (this
  2-core machine, `bench plan-check`, 2026-11-30): a DEP4 step is 33 ms, 27 ms of it in
  nine collectives (~3 ms of wall time each for ~0.1 ms of the rank's own CPU), while
  the mesh took 1.55 of the two processors and nothing else ran; four gloo processes
  doing nothing but all-to-alls take as long per call. The rank's own compute (its
  forward less the collectives: 4.0 ms at DEP2, 3.8-4.7 ms at DEP4) is as much slower
  than the calibration's forward at its batch (3.1, 2.6 ms) as the lone DEP1 rank's is
  (4.6-6.1 against 3.6 ms), with processors idle in both: a speed, not a share of
  processors.

Shapes: S = sampled steps, L = MoE layers, N = ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from moemesh.shared.plan.dims import ModelDims
from moemesh.shared.plan.hardware import Hardware


class Costs(Protocol):
    def dense_s(self, tokens: np.ndarray, attn_flops: np.ndarray, attn_bytes: np.ndarray, width: int,
                phase: str = "decode") -> np.ndarray:
        """[S, N] seconds of each rank's data-parallel part (attention, shared experts, dense
        layers, LM head) for its tokens, with its attention core's FLOPs and KV bytes."""
        ...

    def expert_s(self, pairs: np.ndarray, active: np.ndarray, tokens_per_rank: float, width: int,
                 phase: str = "decode") -> np.ndarray:
        """[S, L, N] seconds of each rank's routed experts per MoE layer: `pairs` computed
        and `active` expert slots whose weights it reads."""
        ...

    def a2a_s(self, pairs_in: np.ndarray, width: int) -> np.ndarray:
        """[S, L] seconds of one layer's dispatch + combine, set by the rank that receives
        the most pairs (`pairs_in` [S, L])."""
        ...

    def sync_s(self, width: int) -> float:
        """Seconds of the ranks' agreement once per step (one small all-gather of a few
        ints, shared/engine/dp.py); 0 at width 1."""
        ...

    def core_wait_s(self, work: np.ndarray, step: np.ndarray) -> np.ndarray:
        """[S] time the step lengthens because ranks wait for a processor to run on, given
        each rank's own work [S, N] and the step as the rest of the model has it [S]."""
        ...


@dataclass(frozen=True)
class Roofline:
    dims: ModelDims
    hw: Hardware

    def dense_s(self, tokens, attn_flops, attn_bytes, width, phase="decode"):
        hw, d = self.hw, self.dims
        # Projections in FP8, the attention core in BF16 (FlashMLA-style kernels).
        compute = 2 * d.dense_params * tokens / (hw.fp8_flops * hw.compute_eff) \
            + attn_flops / (hw.bf16_flops * hw.compute_eff)
        memory = (d.dense_params * d.dense_weight_bytes + attn_bytes) / (hw.hbm_bw * hw.mem_eff)
        return np.maximum(compute, memory)

    def expert_s(self, pairs, active, tokens_per_rank, width, phase="decode"):
        hw, d = self.hw, self.dims
        compute = pairs * d.expert_flops_per_pair / (hw.fp8_flops * hw.compute_eff)
        memory = active * d.expert_bytes / (hw.hbm_bw * hw.mem_eff)
        return np.maximum(compute, memory)

    def a2a_s(self, pairs_in, width):
        if width <= 1:
            return np.zeros_like(pairs_in)
        hw = self.hw
        local, remote = hw.peer_split(width)
        nbytes = pairs_in * self.dims.hidden * 3.0  # FP8 dispatch (1 B), BF16 combine (2 B)
        over_nvlink = nbytes * local / (hw.nvlink_bw * hw.a2a_eff)
        over_net = nbytes * remote / (hw.net_bw * hw.a2a_eff)
        return hw.a2a_latency_s + np.maximum(over_nvlink, over_net)

    def sync_s(self, width):
        return 0.0  # a few ints beside a step of tens of ms; not in the hardware table

    def core_wait_s(self, work, step):
        return np.zeros_like(step)  # a GPU per rank


@dataclass(frozen=True)
class Measured:
    """This host, from one `bench forward` run of the served model.

    Args:
        dims: the benchmarked model.
        batches, forward_s: decode forward time at each batch (one rank, all experts).
        prompt_lens, prefill_s: prefill forward time of one prompt of each length.
        cores: processors' worth of CPU left to the ranks (the machine's cores less what
            other users take); 0: a core per rank. A lower bound on the step, apart from
            each rank's own path (module docstring).
        speed: how fast a rank's forward runs in the mesh against the calibration's
            (`bench forward` alone): its dense and expert parts take 1/speed as long.
        collective_s_by_width: one all-to-all between that many ranks (gloo over
            loopback, small payloads), wall time; a MoE layer makes four (sizes, tokens,
            slots, results back). Widths between or beyond the timed ones are
            interpolated (extrapolated linearly past the widest).
        agree_s_by_width: the ranks' per-step agreement (an all-gather) at that width.
        copy_bw: bytes/s of a collective's payload.
        slot_s, pair_s: the expert kernel per slot that runs and per pair (0: split by FLOPs).
        ep_layer_s: time a DEP>1 rank spends per MoE layer besides the expert kernel and
            the collectives' wait (routing to replicas, sorting by slot, the combine);
            fitted in the mesh, so not scaled by `speed`, and so holding whatever else
            the fitted run took that the model lacks (docs/plan.md).
    """

    dims: ModelDims
    batches: tuple[float, ...]
    forward_s: tuple[float, ...]
    prompt_lens: tuple[float, ...] = ()
    prefill_s: tuple[float, ...] = ()
    cores: float = 0.0
    speed: float = 1.0
    collective_s_by_width: Mapping[int, float] = field(default_factory=dict)
    agree_s_by_width: Mapping[int, float] = field(default_factory=dict)
    copy_bw: float = 5e9
    slot_s: float = 0.0
    pair_s: float = 0.0
    ep_layer_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.batches) != len(self.forward_s) or not self.batches:
            raise ValueError("need one decode forward time per batch")
        if len(self.prompt_lens) != len(self.prefill_s):
            raise ValueError("need one prefill time per prompt length")
        if self.speed <= 0:
            raise ValueError("speed must be > 0")

    def expert_share(self) -> float:
        """The routed experts' share of one token's forward FLOPs."""
        d = self.dims
        experts = d.num_moe_layers * d.top_k * d.expert_flops_per_pair
        return experts / (experts + 2 * d.dense_params)

    def _forward(self, tokens, phase: str = "decode") -> np.ndarray:
        """The measured forward at `tokens` (a decode batch, or a prefill's prompt tokens),
        linear between the measured points and beyond the last two."""
        xs, ys = (self.prompt_lens, self.prefill_s) if phase == "prefill" and self.prompt_lens else \
            (self.batches, self.forward_s)
        t = np.asarray(tokens, dtype=np.float64)
        out = np.interp(t, xs, ys)
        if len(xs) > 1:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            out = np.where(t > xs[-1], ys[-1] + slope * (t - xs[-1]), out)
        return out

    def _dep1_expert_s(self, tokens, phase: str = "decode") -> np.ndarray:
        """The expert part of a DEP1 forward at `tokens` per step, all MoE layers."""
        d = self.dims
        if not (self.slot_s or self.pair_s):
            return self._forward(tokens, phase) * self.expert_share()
        pairs = np.asarray(tokens, dtype=np.float64) * d.top_k
        active = d.num_experts * (1 - (1 - 1 / d.num_experts) ** pairs)  # expected slots hit
        return d.num_moe_layers * (active * self.slot_s + pairs * self.pair_s)

    def dense_s(self, tokens, attn_flops, attn_bytes, width, phase="decode"):
        return np.maximum(self._forward(tokens, phase) - self._dep1_expert_s(tokens, phase), 0.0) / self.speed

    def expert_s(self, pairs, active, tokens_per_rank, width, phase="decode"):
        d = self.dims
        if self.slot_s or self.pair_s:
            per_layer = active * self.slot_s + pairs * self.pair_s
        else:  # at DEP1 the forward at this batch computes tokens * top_k pairs per layer
            per_pair = self._dep1_expert_s(np.asarray(tokens_per_rank), phase) / (
                d.num_moe_layers * max(tokens_per_rank, 1) * d.top_k)
            per_layer = pairs * per_pair
        return per_layer / self.speed + (self.ep_layer_s if width > 1 else 0.0)

    def a2a_s(self, pairs_in, width):
        if width <= 1:
            return np.zeros_like(pairs_in)
        nbytes = pairs_in * self.dims.hidden * 4.0 * 2  # fp32 tokens out and back
        return 4 * by_width(self.collective_s_by_width, width) + nbytes / self.copy_bw

    def sync_s(self, width):
        return by_width(self.agree_s_by_width, width) if width > 1 else 0.0

    def core_wait_s(self, work, step):
        if not self.cores:
            return np.zeros_like(step)
        return np.maximum(work.sum(1) / self.cores - step, 0.0)


@dataclass(frozen=True)
class FixedStep:
    """The mock engine (`engine = "mock"`): every step takes `step_s` on the device,
    whatever the batch; no experts and no collectives."""

    step_s: float

    def dense_s(self, tokens, attn_flops, attn_bytes, width, phase="decode"):
        return np.full(np.shape(tokens), self.step_s)

    def expert_s(self, pairs, active, tokens_per_rank, width, phase="decode"):
        return np.zeros_like(pairs)

    def a2a_s(self, pairs_in, width):
        return np.zeros_like(pairs_in)

    def sync_s(self, width):
        return 0.0

    def core_wait_s(self, work, step):
        return np.zeros_like(step)


@dataclass(frozen=True)
class MockDEPStep:
    """The mock engine as DEP ranks (shared/engine/mock_model.py): a step of `step_s`
    whose part `expert_share` scales, layer by layer, with the most loaded rank's share of
    the routed pairs (the instance waits for it in every layer's all-to-all); the rest is
    the same on every rank. Its all-to-alls are device work inside the step: no separate
    collective term. num_moe_layers: the model's, over which the expert part spreads."""

    step_s: float
    expert_share: float
    num_moe_layers: int

    def dense_s(self, tokens, attn_flops, attn_bytes, width, phase="decode"):
        return np.full(np.shape(tokens), self.step_s * (1 - self.expert_share))

    def expert_s(self, pairs, active, tokens_per_rank, width, phase="decode"):
        """pairs [S, L', N] -> each rank's expert time per layer: the step's expert part
        over the layers, times its pairs over the layer's mean; a layer without pairs
        counts as balanced."""
        mean = pairs.mean(-1, keepdims=True)
        share = np.divide(pairs, mean, out=np.ones_like(pairs, dtype=float), where=mean > 0)
        return self.step_s * self.expert_share / self.num_moe_layers * share

    def a2a_s(self, pairs_in, width):
        return np.zeros_like(pairs_in, dtype=float)

    def sync_s(self, width):
        return 0.0

    def core_wait_s(self, work, step):
        return np.zeros_like(step)


def by_width(table: Mapping[int, float], width: int) -> float:
    """A figure timed at some widths, at `width`: linear between them, the narrowest's
    below it, linear beyond the widest two past it; 0 with none timed."""
    if not table:
        return 0.0
    ws = sorted(table)
    ys = [table[w] for w in ws]
    if width > ws[-1] and len(ws) > 1:
        return max(ys[-1] + (ys[-1] - ys[-2]) / (ws[-1] - ws[-2]) * (width - ws[-1]), 0.0)
    return float(np.interp(width, ws, ys))
