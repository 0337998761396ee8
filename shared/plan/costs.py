"""How long a rank's work takes: the seam between the step model and a machine.

Two kinds of machine plug in:
- Roofline: a GPU from the hardware table. Each part takes the longer of its FLOPs at the
  reached compute rate and its bytes at the reached memory rate.
- Measured: this host, from `bench forward`'s step times of the same model at DEP1.
  The forward at batch b is split into its data-parallel part and its expert part,
  either by the expert kernel's own measured cost (a fixed cost per expert slot that
  runs, plus a cost per pair: `slot_s`, `pair_s`) or, without it, by FLOP shares; a rank
  of a wider instance then takes the dense part at its own batch and the expert part
  for the slots and pairs it runs. Where the ranks share fewer cores than there are
  ranks (this 2-core machine, busy with other work too), a step cannot be shorter than
  all the ranks' CPU work over the cores left to them: each rank computes at full speed
  when it runs, and waits for a core the rest of the time (core_wait_s).

Shapes: S = sampled steps, L = MoE layers, N = ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def core_wait_s(self, work, step):
        return np.zeros_like(step)  # a GPU per rank


@dataclass(frozen=True)
class Measured:
    """This host, from one `bench forward` run of the served model.

    Args:
        dims: the benchmarked model.
        batches, forward_s: decode forward time at each batch (one rank, all experts).
        prompt_lens, prefill_s: prefill forward time of one prompt of each length.
        cores: processors' worth of CPU left to the ranks (the machine's cores less what the
            gateway, NATS, the clients and other users take); 0: a core per rank.
        collective_s: one collective call between ranks (gloo over loopback); a MoE layer
            makes four (sizes, tokens, slots, results back).
        copy_bw: bytes/s of a collective's payload.
        slot_s, pair_s: the expert kernel per slot that runs and per pair (0: split by FLOPs).
        ep_layer_s: CPU a DEP>1 rank spends per MoE layer besides the expert kernel
            (routing to replicas, sorting by slot, driving the collectives).
    """

    dims: ModelDims
    batches: tuple[float, ...]
    forward_s: tuple[float, ...]
    prompt_lens: tuple[float, ...] = ()
    prefill_s: tuple[float, ...] = ()
    cores: float = 0.0
    collective_s: float = 0.0
    copy_bw: float = 5e9
    slot_s: float = 0.0
    pair_s: float = 0.0
    ep_layer_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.batches) != len(self.forward_s) or not self.batches:
            raise ValueError("need one decode forward time per batch")
        if len(self.prompt_lens) != len(self.prefill_s):
            raise ValueError("need one prefill time per prompt length")

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
        return np.maximum(self._forward(tokens, phase) - self._dep1_expert_s(tokens, phase), 0.0)

    def expert_s(self, pairs, active, tokens_per_rank, width, phase="decode"):
        d = self.dims
        if self.slot_s or self.pair_s:
            per_layer = active * self.slot_s + pairs * self.pair_s
        else:  # at DEP1 the forward at this batch computes tokens * top_k pairs per layer
            per_pair = self._dep1_expert_s(np.asarray(tokens_per_rank), phase) / (
                d.num_moe_layers * max(tokens_per_rank, 1) * d.top_k)
            per_layer = pairs * per_pair
        return per_layer + (self.ep_layer_s if width > 1 else 0.0)

    def a2a_s(self, pairs_in, width):
        if width <= 1:
            return np.zeros_like(pairs_in)
        nbytes = pairs_in * self.dims.hidden * 4.0 * 2  # fp32 tokens out and back
        return 4 * self.collective_s + nbytes / self.copy_bw

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

    def core_wait_s(self, work, step):
        return np.zeros_like(step)
