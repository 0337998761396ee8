"""The expert-parallel load balancer.

Per DEP instance: collect every rank's windowed expert loads, and every
check_interval_s decide (policy + hysteresis) whether a new placement is worth a move;
if so, carry the move out across the ranks (mover.py) without stopping decode.
Target layers and the MTP draft layer are reported apart: they route differently.

Lifecycle of an instance here: unseen -> observing (loads arrive) -> steady <-> moving.
"""

from __future__ import annotations

import asyncio
import logging
import time

from moemesh.services.balancer.config import BalancerConfig
from moemesh.services.balancer.mover import MoveCoordinator
from moemesh.services.balancer.policy import Decider, propose
from moemesh.services.balancer.state import InstanceView
from moemesh.shared.protocol.messages import ExpertLoad, MoveDone, MoveStaged, RebalanceReply, RebalanceRequest
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.dep_runtime import tensor_from
from moemesh.shared.service.lifecycle import AsyncService
from moemesh.shared.service.metrics_http import MetricsServer
from moemesh.shared.service.nats_io import connect, disconnect, subscribe
from moemesh.shared.service.tasks import TaskSet
from moemesh.shared.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


class BalancerService(AsyncService):
    def __init__(self, cfg: BalancerConfig):
        self.cfg = cfg
        self.subjects = Subjects(cfg.subject_prefix)
        self.instances: dict[str, InstanceView] = {}
        self.deciders: dict[str, Decider] = {}
        self.metrics = Metrics(const_labels={"model_name": cfg.model_name} if cfg.model_name else None)
        m = self.metrics
        self.g_ratio = m.gauge("eplb_balance_ratio", "instance balance ratio, mean/max rank load",
                               ("instance", "model"))
        self.g_layer = m.gauge("eplb_layer_balance_ratio", "per-layer balance ratio", ("instance", "layer"))
        self.c_moves = m.counter("eplb_moves_total", "expert moves by outcome", ("instance", "outcome"))
        self.h_move = m.histogram("eplb_move_seconds", "plan to every rank switched")
        self.h_policy = m.histogram("eplb_policy_seconds", "placement computation time")
        self.c_bytes = m.counter("eplb_bytes_moved_total", "expert weight bytes copied between ranks")
        self.nc = None
        self.mover: MoveCoordinator | None = None
        self._tasks = TaskSet()
        self._http: MetricsServer | None = None


    async def start(self) -> None:
        self.nc = await connect(self.cfg, "moemesh-balancer")
        self.mover = MoveCoordinator(self.nc, self.subjects, self.cfg.move_timeout_s,
                                     self.cfg.debug_commit_delay_s)
        s = self.subjects
        await subscribe(self.nc, s.eplb_all("load"), ExpertLoad, self._on_load)
        await subscribe(self.nc, s.eplb_all("staged"), MoveStaged, self._on_staged)
        await subscribe(self.nc, s.eplb_all("done"), MoveDone, self._on_done)
        await subscribe(self.nc, s.eplb_all("rebalance"), RebalanceRequest, self._on_rebalance)
        if self.cfg.auto:
            self._tasks.spawn(self._watch(), "eplb-watch")
        if self.cfg.metrics_port >= 0:
            self._http = MetricsServer(self.metrics, lambda: {"status": "ok",
                                                                     "instances": list(self.instances)},
                                       self.cfg.metrics_host, self.cfg.metrics_port)
            await self._http.start()
        log.info("balancer ready (algorithm %s, auto %s)", self.cfg.algorithm, self.cfg.auto)

    async def drain(self) -> None:
        while any(v.moving for v in self.instances.values()):
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self._tasks.close()
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self.nc is not None:
            nc, self.nc = self.nc, None
            await disconnect(nc)

    # ---- observing ----------------------------------------------------------------------
    async def _on_load(self, m: ExpertLoad, msg, ctx) -> None:
        view = self.instances.get(m.instance_id)
        if view is None or (view.dp_size, view.layer_ids, view.num_experts, view.slots_per_rank) != \
                (m.dp_size, list(m.layer_ids), m.num_experts, m.slots_per_rank):
            view = self.instances[m.instance_id] = InstanceView.from_load(m)
            self.deciders[m.instance_id] = Decider(self.cfg)
        try:
            view.observe(m)
        except ValueError as e:
            log.warning("instance %s: load report ignored: %s", m.instance_id, e)
            return
        if view.complete:
            self._export_ratios(view)

    def _export_ratios(self, view: InstanceView) -> None:
        p, loads = view.placement(), view.loads()
        for which, rows in (("target", view.rows(draft=False)), ("draft", view.rows(draft=True))):
            if rows:
                rl = p.rank_loads(loads)[rows]
                peak = float(rl.amax(-1).sum())
                self.g_ratio.labels(view.instance_id, which).set(float(rl.mean(-1).sum()) / peak if peak else 1.0)
        for i, r in enumerate(p.layer_ratios(loads).tolist()):
            self.g_layer.labels(view.instance_id, str(view.layer_ids[i])).set(r)

    async def _on_staged(self, m: MoveStaged, msg, ctx) -> None:
        self.mover.on_staged(m)

    async def _on_done(self, m: MoveDone, msg, ctx) -> None:
        self.mover.on_done(m)

    # ---- deciding and moving ------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.check_interval_s)
            for view in list(self.instances.values()):
                if not view.complete or view.moving:
                    continue
                loads = view.loads()
                if int(loads.sum()) < self.cfg.min_window_tokens:
                    continue
                decider = self.deciders[view.instance_id]
                chosen = decider.judge(view.placement(), loads)  # last window's candidate, on this window
                if chosen is not None:
                    await self._move(view, chosen.phy2log)
                    continue
                decider.pending, secs = propose(view, loads, self.cfg)
                self.h_policy.observe(secs)

    async def _move(self, view: InstanceView, new) -> RebalanceReply:
        """One move, or with layers_per_move one move per group of changed layers in turn, so
        each switch copies (and stages) less at a time."""
        k = self.cfg.layers_per_move
        rows = [i for i in range(new.shape[0]) if not bool((new[i] == view.phy2log[i]).all())]
        if k <= 0 or len(rows) <= k:
            return await self._move_once(view, new)
        total = RebalanceReply(True)
        for i in range(0, len(rows), k):
            step = view.phy2log.clone()
            step[rows[i : i + k]] = new[rows[i : i + k]]
            r = await self._move_once(view, step)
            total.move_id, total.move_seconds = r.move_id, total.move_seconds + r.move_seconds
            total.bytes_moved += r.bytes_moved
            total.slots_changed += r.slots_changed
            total.ratio_before = total.ratio_before or r.ratio_before
            if not r.ok:
                total.ok, total.error = False, r.error  # the layers moved so far stay: each move was whole
                break
        return total

    async def _move_once(self, view: InstanceView, new) -> RebalanceReply:
        view.moving = True
        try:
            before = view.placement().instance_ratio(view.loads()) if view.loads_by_rank else 0.0
            res = await self.mover.move(view.instance_id, view.dp_size, view.version, new)
        finally:
            view.moving = False
        outcome = "ok" if res.ok else "failed"
        self.c_moves.labels(view.instance_id, outcome).inc()
        changed = int((new != view.phy2log).sum())
        if res.ok:
            self.h_move.observe(res.seconds)
            self.c_bytes.inc(res.bytes_moved)
            # The ranks' own count, not ours + 1: a load report sent after the switch may
            # already have told us the new version.
            view.phy2log, view.version = new.clone(), res.version
            view.last_move_at = time.monotonic()
            log.info("instance %s: move %d done in %.3fs, %d slots, %d bytes", view.instance_id, res.move_id,
                     res.seconds, changed, res.bytes_moved)
        else:
            log.warning("instance %s: move %d failed: %s; old placement kept", view.instance_id, res.move_id,
                        res.error)
        return RebalanceReply(res.ok, res.error, res.move_id, before, 0.0, 0.0, res.seconds, res.bytes_moved,
                              changed)

    async def _on_rebalance(self, req: RebalanceRequest, msg, ctx) -> RebalanceReply:
        view = self.instances.get(req.instance_id)
        if view is None or not view.complete:
            return RebalanceReply(False, f"instance {req.instance_id!r} has not reported loads yet")
        if view.moving:
            return RebalanceReply(False, "a move is already in progress")
        loads = view.loads()
        policy_s = 0.0
        if req.phy2log:
            try:
                new = tensor_from(req.phy2log, req.num_layers)
                from moemesh.shared.eplb.placement import Placement

                Placement(new, view.num_experts, view.dp_size)
            except ValueError as e:
                return RebalanceReply(False, f"bad placement: {e}")
        else:
            cand, policy_s = propose(view, loads, self.cfg)
            new = cand.phy2log
        expected = _ratio(view, new, loads)
        reply = await self._move(view, new)
        reply.ratio_after_expected, reply.policy_seconds = expected, policy_s
        return reply


def _ratio(view: InstanceView, phy2log, loads) -> float:
    from moemesh.shared.eplb.placement import Placement

    return Placement(phy2log, view.num_experts, view.dp_size).instance_ratio(loads)
