"""The expert-parallel side of a worker rank: lockstep group, expert slots, load
tracking and publishing, routing skew, and live expert moves."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import torch

from moemesh.shared.checkpoint.loader import load_model
from moemesh.shared.config.common import WorkerConfig
from moemesh.shared.engine.config import EngineConfig
from moemesh.shared.engine.dp import DPGroup
from moemesh.shared.engine.engine import LLMEngine
from moemesh.shared.engine.load_tracker import LoadTracker
from moemesh.shared.engine.mock_model import MockModel, MockRanks
from moemesh.shared.model.config import ModelConfig
from moemesh.shared.model.expert_parallel import ExpertParallel
from moemesh.shared.model.skew import apply_skew
from moemesh.shared.protocol.messages import Ack, ErrorReply, ExpertLoad, Heartbeat, MoveAbort, MoveCommit, MoveDone, MovePlan, MoveStaged
from moemesh.shared.service.engine_loop import EngineLoop
from moemesh.shared.service.expert_moves import MoveAgent
from moemesh.shared.protocol.registry import WorkerRegistry
from moemesh.shared.service.lockstep import Lockstep
from moemesh.shared.service.nats_io import Spawn
from moemesh.shared.service.parts import Bus
from moemesh.shared.transport.base import KVTransport
from moemesh.shared.transport.staging import StagingPool

log = logging.getLogger(__name__)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.to(torch.int64).numpy().astype("<i8").tobytes()


def tensor_from(b: bytes, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(b, dtype="<i8").copy()).view(rows, -1)


class DepRuntime:
    """Built from the worker's config; handed the transport and staging memory once they
    are up (attach), then the bus, the engine loop and the worker's tasks (start)."""

    def __init__(self, cfg: WorkerConfig, role: str):
        self.cfg = cfg
        self.role = role
        self.dp: DPGroup | None = None
        self.ep: ExpertParallel | None = None
        self.tracker: LoadTracker | None = None
        self.agent: MoveAgent | None = None
        self.lockstep: Lockstep | None = None
        self.peers = WorkerRegistry()
        self._transport: KVTransport | None = None
        self._bus: Bus | None = None
        self._loop: EngineLoop | None = None
        self._spawn: Spawn | None = None
        self._mock: MockModel | None = None  # a mock rank: its device's wait for the other ranks

    def build_engine(self, role: str) -> LLMEngine:
        """Blocking: joins the instance's process group (waits for every rank), then loads
        only this rank's expert slots."""
        cfg = self.cfg
        self.dp = DPGroup(cfg.dp_rank, cfg.dp_size, cfg.dist_init, "cpu" if cfg.engine == "mock" else cfg.device,
                          cfg.dp_timeout_s)
        mcfg = ModelConfig.from_dir(cfg.model)
        if mcfg.n_routed_experts % cfg.dp_size:
            raise ValueError(f"{mcfg.n_routed_experts} experts do not divide over {cfg.dp_size} ranks")
        slots, S = ExpertParallel.naive_slot_map(mcfg.n_routed_experts, cfg.dp_rank, cfg.dp_size, cfg.eplb_redundant,
                                                 cfg.expert_placement)
        ecfg = EngineConfig.for_worker(cfg, role)
        if cfg.engine == "mock":
            ranks = MockRanks(cfg.dp_rank, cfg.dp_size, cfg.mock_expert_share, seed=cfg.skew_seed)
            accept = cfg.mock_accept_rate if cfg.mock_accept_rate >= 0 else None
            model = MockModel(mcfg, cfg.mock_step_ms / 1e3, accept, ranks, slots, cfg.max_model_len)
            self._mock = model
        else:
            model = load_model(cfg.model, ecfg.torch_dtype, cfg.device, expert_slots=slots, num_slots=S)
        self.ep = ExpertParallel.naive(model, cfg.dp_rank, cfg.dp_size, cfg.eplb_redundant,
                                       strategy=cfg.expert_placement)
        return LLMEngine(ecfg, model=model, lockstep=True)

    def attach(self, engine: LLMEngine, transport: KVTransport, staging: StagingPool) -> None:
        """Skew applies to any engine, expert-parallel or not; load tracking to an
        expert-parallel one, whose loads the balancer reads."""
        cfg = self.cfg
        self._transport = transport
        if cfg.skew or cfg.draft_skew:
            apply_skew(engine.model, cfg.skew, cfg.draft_skew, cfg.skew_seed)
            log.info("routing skew on: target %r, draft %r", cfg.skew, cfg.draft_skew)
        if self.ep is not None:
            self.tracker = LoadTracker(engine.model, cfg.load_window_steps)
            self.agent = MoveAgent(self.ep, transport, staging, self._peer_address,
                                   cfg.move_timeout_s, cfg.debug_fail_move)
            self.lockstep = Lockstep(self.dp, lambda: self.agent.ready_move_id, self._switch)

    async def start(self, bus: Bus, loop: EngineLoop, spawn: Spawn) -> None:
        self._bus, self._loop, self._spawn = bus, loop, spawn
        if self.ep is None:
            return
        inst, s = self.cfg.instance, bus.subjects
        await bus.on_heartbeat(self._on_heartbeat)
        await bus.sub(s.eplb(inst, "plan"), MovePlan, self._on_plan)
        await bus.sub(s.eplb(inst, "commit"), MoveCommit, self._on_commit)
        await bus.sub(s.eplb(inst, "abort"), MoveAbort, self._on_abort)
        spawn(self._publish_loads(), "load-publisher")

    @property
    def expert_parallel(self) -> bool:
        """Whether this worker is a rank with expert slots (its engine built here)."""
        return self.ep is not None

    def on_step(self) -> tuple[float, float, float]:
        """After each step of an expert-parallel rank: closes the step's expert loads and
        returns (comm_s, agree_s, skew_s): the time in expert collectives since last
        asked, the step's agreement, and on a mock rank the instance's step less its own
        (the slower ranks' expert time it waited for inside the step; a GPU does not tell)."""
        self.tracker.end_step()
        m = self._mock
        comm = self.ep.take_comm_s() + (m.take_comm_s() if m is not None else 0.0)
        skew = m.last_instance_s - m.last_own_s if m is not None else 0.0
        return comm, self.lockstep.last_agree_s, skew

    @property
    def placement_version(self) -> int:
        return self.agent.version if self.agent is not None else 0

    def close(self) -> None:
        if self._mock is not None:
            self._mock.ranks.close()
        if self.dp is not None:
            self.dp.close()

    # ---- loads --------------------------------------------------------------------------
    def load_message(self) -> ExpertLoad:
        cfg, tr = self.cfg, self.tracker
        phy = self.ep.phy2log()
        return ExpertLoad(
            instance_id=cfg.instance, rank=cfg.dp_rank, dp_size=cfg.dp_size,
            step=self.lockstep.step if self.lockstep else tr.total_steps, window_steps=tr.window_steps,
            layer_ids=tr.layer_ids, num_target_layers=tr.num_target_layers, num_experts=tr.num_experts,
            counts=tensor_bytes(tr.window()), slots_per_rank=phy.shape[1] // cfg.dp_size,
            placement_version=self.agent.version, phy2log=tensor_bytes(phy) if cfg.dp_rank == 0 else b"")

    async def _publish_loads(self) -> None:
        subject = self._bus.subjects.eplb(self.cfg.instance, "load")
        while True:
            await asyncio.sleep(self.cfg.load_publish_interval_s)
            try:
                await self._bus.publish(subject, self.load_message())
            except Exception as e:  # NATS reconnecting; the next publish will do
                log.debug("expert load not published: %s", e)

    # ---- moves --------------------------------------------------------------------------
    def _on_heartbeat(self, hb: Heartbeat) -> None:
        if hb.instance_id == self.cfg.instance:
            self.peers.observe(hb)

    def _peer_address(self, rank: int) -> bytes | None:
        if rank == self.cfg.dp_rank:
            return self._transport.address
        for hb in self.peers.live(self.role):
            if hb.dp_rank == rank:
                return hb.address
        return None

    async def _on_plan(self, plan: MovePlan, msg, ctx):
        """Plans are published to every rank at once; each answers with MoveStaged."""
        error = ""
        if plan.base_version != self.agent.version:
            error = f"stale plan: built on placement {plan.base_version}, this rank has {self.agent.version}"
        else:
            try:
                new = tensor_from(plan.phy2log, plan.num_layers)
            except ValueError as e:
                error = f"bad placement bytes: {e}"
        if error:
            await self._bus.publish(self._bus.subjects.eplb(self.cfg.instance, "staged"),
                                    MoveStaged(self.cfg.instance, plan.move_id, self.cfg.dp_rank, False, error=error))
            return ErrorReply(error, "conflict")
        self._spawn(self._stage(plan, new), f"move-{plan.move_id}")
        return Ack()

    async def _stage(self, plan: MovePlan, new: torch.Tensor) -> None:
        t0 = time.monotonic()
        subj = self._bus.subjects.eplb(self.cfg.instance, "staged")
        try:
            move = await self.agent.stage(plan.move_id, new)
            staged = MoveStaged(self.cfg.instance, plan.move_id, self.cfg.dp_rank, True,
                                bytes_received=move.bytes_received, bytes_sent=move.bytes_sent,
                                seconds=time.monotonic() - t0)
        except Exception as e:
            log.warning("expert move %d failed on this rank: %s", plan.move_id, e)
            await self.agent.abort(plan.move_id)
            staged = MoveStaged(self.cfg.instance, plan.move_id, self.cfg.dp_rank, False, error=str(e))
        await self._bus.publish(subj, staged)
        if staged.ok:
            self._spawn(self._expire(plan.move_id, plan.timeout_s), f"move-expiry-{plan.move_id}")

    async def _expire(self, move_id: int, timeout_s: float) -> None:
        """No commit in time (the balancer died?): drop the staged move; nothing switched."""
        await asyncio.sleep(timeout_s)
        if self.agent.move is not None and self.agent.move.move_id == move_id:
            log.warning("expert move %d was never committed; dropping it", move_id)
            await self.agent.abort(move_id)

    async def _on_commit(self, c: MoveCommit, msg, ctx) -> None:
        self.agent.mark_ready(c.move_id)
        self._loop.wake()

    async def _on_abort(self, a: MoveAbort, msg, ctx) -> None:
        await self.agent.abort(a.move_id)

    def _switch(self) -> None:
        t0 = time.perf_counter()
        move_id = self.agent.move.move_id
        version = self.agent.switch()
        done = MoveDone(self.cfg.instance, move_id, self.cfg.dp_rank, version, self.lockstep.step,
                        time.perf_counter() - t0)
        log.info("switched to expert placement %d (move %d) at step %d", version, move_id, self.lockstep.step)
        subject = self._bus.subjects.eplb(self.cfg.instance, "done")
        self._spawn(self._bus.publish(subject, done), f"move-done-{move_id}")
