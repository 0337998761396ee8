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

As a rank of a DEP-N instance (built with MockRanks) the mock has MoE layers: each row's
experts are drawn with the project's routing (and any skew), counted by the load tracker,
and dealt to the instance's expert slots as the real dispatcher deals them. The step's
all-to-alls are device work: one exchange of (start, pairs sent to each rank) per step,
queued as an asynchronous collective, as NCCL or DeepEP run on a GPU's stream, never on the
host's path. From it every rank derives the same step: a rank's expert part scales with its share
of the pairs, and since every layer's all-to-all waits for the slowest rank, the instance
runs at the pace of the most loaded rank of each layer, from the latest rank's start.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch import nn

from moemesh.shared.kernels.route import route_ref
from moemesh.shared.model.batch import ForwardBatch
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.expert_parallel import to_replicas
from moemesh.shared.model.moe import Experts


def lockstep_step(step_s: float, expert_share: float, starts: torch.Tensor, sent: torch.Tensor,
                  rank: int) -> tuple[float, float, float]:
    """One DEP step as every rank's device sees it. Pure, so all ranks agree.

    Args:
        step_s: a balanced step's time; expert_share: s, its part that scales with load.
        starts: [N] when each rank's device began the step.
        sent: [N src, L, N dst] routed pairs each rank sent to each rank, per MoE layer.
        rank: whose view.
    Returns:
        (end, own_s, instance_s): when the step ends on every rank (the latest start plus the
        instance's step), this rank's own step, step_s × ((1 - s) + s × its load / the mean
        load), and the instance's, where each layer's expert part takes its most loaded
        rank's time. Layers no pair reached count as balanced.
    """
    load = sent.double().sum(0)  # [L, N] pairs each rank's experts ran
    mean = load.mean(1, keepdim=True)
    used = mean[:, 0] > 0
    if used.any():
        ratio = load[used] / mean[used]
        own, inst = float(ratio[:, rank].mean()), float(ratio.amax(1).mean())
    else:
        own = inst = 1.0
    own_s = step_s * ((1 - expert_share) + expert_share * own)
    inst_s = step_s * ((1 - expert_share) + expert_share * inst)
    return float(starts.max()) + inst_s, own_s, inst_s


class MockRanks:
    """The mock's side of a DEP instance: which rank it is, and its device's exchange.

    The exchange is queued, like a stream's work: an asynchronous gloo all-gather on `group`
    (the instance's main group, which the mock's MoE layers would otherwise use; the
    lockstep agreement has its own), run by gloo's own worker in submission order while the
    host goes on. It is bounded by the group's timeout: a dead peer fails the step, it never
    hangs."""

    def __init__(self, rank: int, world: int, expert_share: float = 0.5, group=None, seed: int = 0):
        if not 0 <= expert_share <= 1:
            raise ValueError(f"mock_expert_share must be in [0, 1], got {expert_share}")
        self.rank, self.world, self.expert_share, self.group = rank, world, expert_share, group
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)  # routing draws, reproducible per rank

    def submit(self, step_s: float, start: float, sent: torch.Tensor) -> "Exchange":
        """sent: [L, N] pairs this rank sends to each rank. result() gives lockstep_step's
        (end, own_s, instance_s)."""
        mine = torch.cat([torch.tensor([start], dtype=torch.float64), sent.reshape(-1).double()])
        if self.world == 1:
            return Exchange(self, step_s, sent.shape, [mine], None)
        got = [torch.empty_like(mine) for _ in range(self.world)]
        return Exchange(self, step_s, sent.shape, got, dist.all_gather(got, mine, group=self.group, async_op=True))

    def close(self) -> None:
        pass


class Exchange:
    """One step's exchange in flight: every rank's (start, pairs sent)."""

    def __init__(self, ranks: MockRanks, step_s: float, shape, got: list[torch.Tensor], work):
        self._ranks, self._step_s, self._shape, self._got, self._work = ranks, step_s, shape, got, work

    def result(self) -> tuple[float, float, float]:
        if self._work is not None:
            self._work.wait()
        r = self._ranks
        every = torch.stack(self._got)  # [N, 1 + L*N]
        return lockstep_step(self._step_s, r.expert_share, every[:, 0], every[:, 1:].view(r.world, *self._shape),
                             r.rank)


class _DeviceState:
    """The mock device's clock and what its running step has in flight."""

    __slots__ = ("started", "late", "free_at", "draft_sent", "step", "wait_s", "last_own_s", "last_instance_s")

    def __init__(self) -> None:
        self.started = 0.0
        self.late = 0.0  # how late the sleep's wake-up has been, on average
        self.free_at = 0.0  # when the step the device runs now is done
        self.draft_sent: torch.Tensor | None = None  # the last drafts' pairs, sent with the next step's
        self.step: Exchange | None = None
        self.wait_s = 0.0  # device time waiting for other ranks, since last taken
        self.last_own_s = self.last_instance_s = 0.0


class _Gate:
    """What a skew sets on a router (shared/model/skew.py): a bias on the choice scores."""

    def __init__(self) -> None:
        self.choice_bias: torch.Tensor | None = None


class MockMoE(nn.Module):
    """One MoE layer of a mock rank: routing without a model, and real expert slots, so a
    live move carries weight bytes. Each slot's weights hold its logical expert's id (set
    at start-up; a move copies them), which tells a test which expert a slot holds."""

    def __init__(self, cfg: ModelConfig, layer_id: int, slot_experts: list[int]):
        super().__init__()
        self.layer_id = layer_id
        self.gate = _Gate()
        self.experts = Experts(len(slot_experts), cfg.hidden_size, cfg.moe_intermediate_size)
        with torch.no_grad():
            for i, e in enumerate(slot_experts):
                self.experts.gate_up_proj[i].fill_(e)
                self.experts.down_proj[i].fill_(e)
        self.runner = None  # the EPLayer, set by ExpertParallel: its placement and replica deal
        self.on_route = None  # the load tracker's hook
        self._kw = dict(top_k=cfg.num_experts_per_tok, scoring=cfg.scoring_func,
                        n_group=getattr(cfg, "n_group", 1) if getattr(cfg, "topk_method", "") in
                        ("noaux_tc", "group_limited_greedy") else 1,
                        topk_group=getattr(cfg, "topk_group", 1),
                        group_score="top2" if getattr(cfg, "topk_method", "") == "noaux_tc" else "max")
        self.num_experts = cfg.n_routed_experts

    def route(self, num_rows: int, gen: torch.Generator) -> torch.Tensor:
        """[N ranks] pairs this layer sends to each rank for num_rows rows."""
        return route_layers([self], num_rows, gen)[0]


def route_layers(layers: list[MockMoE], num_rows: int, gen: torch.Generator) -> torch.Tensor:
    """[L, N ranks] pairs each layer sends to each rank for num_rows rows. Router logits
    are drawn at random; the choice is the real routing's, each layer's skew included.
    The layers share one config, so one draw and one routing call serve them all: a mock
    of a many-layer model costs the host what a few layers do."""
    world = layers[0].runner.world
    L, E = len(layers), layers[0].num_experts
    if num_rows == 0:
        return torch.zeros(L, world, dtype=torch.long)
    logits = torch.randn(L * num_rows, E, generator=gen)
    biases = [m.gate.choice_bias for m in layers]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.stack([torch.zeros(E) if b is None else b.float() for b in biases])
        bias = bias.repeat_interleave(num_rows, dim=0) if L > 1 else bias[0]
    _, ids = route_ref(logits, choice_bias=bias, **layers[0]._kw)
    ids = ids.view(L, num_rows, -1)
    sent = torch.empty(L, world, dtype=torch.long)
    for i, m in enumerate(layers):
        if m.on_route is not None:
            m.on_route(m.layer_id, ids[i])
        r = m.runner
        phy = to_replicas(ids[i].reshape(-1), r.log2phy, r.counts, r.turn, r.one_each)
        sent[i] = torch.bincount(phy // r.slots_per_rank, minlength=world)
    return sent


class MockModel(nn.Module):
    def __init__(self, cfg: ModelConfig, step_time_s: float, accept_rate: float | None = None,
                 ranks: MockRanks | None = None, expert_slots=None, max_model_len: int = 0):
        """cfg: any model's config (V2/V3 or V4); only its sizes and tokens are used.
        accept_rate: None, no draft head (one token per sequence a step); else it has one,
        whose every draft the target accepts with this probability (see mtp_logits).
        ranks: as a rank of a DEP instance (then expert_slots, MoE layer id -> the logical
        expert of each local slot, as the checkpoint loader takes it): MoE layers, the
        target's and with a draft head the MTP layer's, whose load shapes the step.
        max_model_len: the context to serve; past the model's positions, the mock's config
        has that many (it computes nothing, so any length fits but the KV blocks')."""
        super().__init__()
        self.cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0 if accept_rate is None else 1,
                                       max_position_embeddings=max(cfg.max_position_embeddings, max_model_len))
        self.accept_rate = accept_rate
        self.wants_row_keys = accept_rate is not None  # drafts are decided per (request, position)
        self.step_time_s = step_time_s
        self._dev = _DeviceState()  # set every step: a plain object, not nn.Module attributes (slow to set)
        self.ranks = ranks
        self.moe: dict[int, MockMoE] = {}
        if ranks is not None:
            ids = list(cfg.moe_layer_ids) + ([cfg.num_hidden_layers] if accept_rate is not None else [])
            self.moe = {lid: MockMoE(cfg, lid, expert_slots(lid)) for lid in ids}
        self._target = [m for lid, m in self.moe.items() if lid < cfg.num_hidden_layers]
        self._mtp = self.moe.get(cfg.num_hidden_layers)

    @property
    def last_own_s(self) -> float:
        return self._dev.last_own_s

    @property
    def last_instance_s(self) -> float:
        return self._dev.last_instance_s

    def moe_layers(self) -> dict:
        return dict(self.moe)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor) -> torch.Tensor:
        now, d = time.perf_counter(), self._dev
        queued = batch.queued_at or now
        d.started = min(now, max(queued, d.free_at))
        d.free_at = d.started + self.step_time_s
        if self.ranks is not None:
            sent = route_layers(self._target, batch.num_tokens, self.ranks.gen)
            if d.draft_sent is not None:
                sent = torch.cat([sent, d.draft_sent])
            d.draft_sent = None
            d.step = self.ranks.submit(self.step_time_s, d.started, sent)
        return self._hidden(batch, 0)

    def take_comm_s(self) -> float:
        """Device time spent waiting for the instance's other ranks since last asked: for a
        later start, and for busier experts."""
        w, self._dev.wait_s = self._dev.wait_s, 0.0
        return w

    def synchronize(self) -> None:
        """Wait for the step's device time to be up. The sleep releases the GIL, as a
        wait for a device would. The OS wakes a sleeper late (0.1-0.2 ms on a busy VM,
        1% of a 20 ms step): the sleep is cut by how late recent wake-ups were, so that
        steps take the set time on average.

        One wake-up counts as at most a quarter step late: a process starved of CPU for a
        while wakes far later than that, and if such a stall entered the correction whole,
        later steps would be cut short. Where the host then took the rest of the shortened
        step, no sleep would run to correct it back, and the mock would run as fast as its
        host, reporting its set step time all along.

        As a DEP rank, the step ends when the instance's does (lockstep_step); waiting for
        the device's exchange is waiting for the slowest rank, as in a collective."""
        d = self._dev
        end = d.started + self.step_time_s
        if d.step is not None:
            step, d.step = d.step, None
            end, own_s, inst_s = step.result()
            d.free_at = end
            d.wait_s += end - (d.started + own_s)
            d.last_own_s, d.last_instance_s = own_s, inst_s
        wake = end - d.late
        left = wake - time.perf_counter()
        if left > 0:
            time.sleep(left)
            late = min(time.perf_counter() - wake, self.step_time_s / 4)
            d.late = 0.9 * d.late + 0.1 * late

    def device_window(self) -> tuple[float, float]:
        """(start, end) of the last step on the mock device's clock."""
        return self._dev.started, self._dev.free_at

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits(self._token(hidden[:, 0].to(torch.long)))

    # ---- the draft head (accept_rate set) ------------------------------------------------
    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, kv_caches) -> torch.Tensor:
        """A row at position p drafts the token the target emits from position p + 1:
        its "hidden state" is that position. Device time: inside the step's, as the
        verification queued before it is. As a DEP rank, the drafts' expert pairs travel
        with the next step's (the device runs them in turn). A draft pass queued after the
        step's time is up starts when it is queued: the device waited for the host.
        """
        d = self._dev
        d.free_at = max(d.free_at, time.perf_counter())
        if self._mtp is not None:
            sent = self._mtp.route(batch.num_tokens, self.ranks.gen)[None]
            d.draft_sent = sent if d.draft_sent is None else d.draft_sent + sent
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
        """One-hot in effect at any temperature up to 2: a sampled request takes the hashed
        token as a greedy one does (at a peak of 10 it took another token 4% of the time at
        temperature 1, and rejected that much more of the drafts than mock_accept_rate)."""
        logits = torch.zeros(tok.shape[0], self.cfg.vocab_size)
        logits.scatter_(1, tok[:, None], 40.0)
        return logits


def _unit_hash(key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A fraction in [0, 1) per (key, position), mixed so that neighbouring positions are
    unrelated: each draft's fate is its own, whichever positions a sequence's earlier
    acceptances make it draft at."""
    x = (key & 0xFFFFFFFF) * 0x9E3779B1 + pos * 0x632BE5AB + 0x1B873593
    for shift, mul in ((16, 0x45D9F3B), (16, 0x45D9F3B), (16, 1)):
        x = ((x ^ (x >> shift)) * mul) & 0xFFFFFFFF
    return x.to(torch.float64) / 2**32
