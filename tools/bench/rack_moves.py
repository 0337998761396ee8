"""`moemesh bench rack`'s cut moves: a live expert move on the DEP2 instance, cut between
the moment every rank has staged the new weights and the commit that switches them.

The rack's balancer runs with `debug_commit_delay_s`, so the window between staged and
commit is long enough to strike in; the bench asks it for the largest move there is (every
expert changes rank) and, once both ranks report the move staged, kills the victim:
- the balancer: no commit ever comes, and each rank drops its staging when the move
  times out (`move_timeout_s`);
- a rank: its peer cannot complete the move's lockstep and leaves; its streams migrate.

What is judged afterwards, from the ranks' logs: no rank switched to the new placement (a
move commits on every rank or on none, so none here), and in the first case both dropped
it. That the streams' text is unchanged is judged as in every scenario (the mock engine's
text is the same for every stream; with --real, the offline engine's)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from moemesh.shared.protocol.messages import ExpertLoad, MoveStaged, RebalanceReply, RebalanceRequest, decode
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.dep_runtime import tensor_bytes, tensor_from
from moemesh.shared.service.nats_io import request

SWITCHED = "switched to expert placement"
DROPPED = "was never committed; dropping it"


def balancer_sets(commit_delay_s: float, move_timeout_s: float) -> list[str]:
    """The rack's balancer for a cut move: it moves only when asked, and holds each commit back."""
    return ["auto=false", f"debug_commit_delay_s={commit_delay_s}", f"move_timeout_s={move_timeout_s}"]


def every_expert_moves(phy2log: torch.Tensor, world: int) -> torch.Tensor:
    """Pure: the placement where each rank's slots hold what the next rank's held (for two
    ranks, the halves swapped), so every expert changes rank."""
    return torch.roll(phy2log, shifts=phy2log.shape[1] // world, dims=1)


async def cut_move(nats_url: str, instance: str, world: int, kill, timeout_s: float = 60.0) -> float:
    """Ask the balancer for a move of every expert; once all `world` ranks have staged it,
    call kill(). Returns the unix time of the kill."""
    import nats

    s = Subjects()
    nc = await nats.connect(nats_url.split(","), dont_randomize=True)
    try:
        loads = await nc.subscribe(s.eplb(instance, "load"))
        staged = await nc.subscribe(s.eplb(instance, "staged"))
        deadline = time.monotonic() + timeout_s
        while True:  # rank 0's report carries the placement in force
            load = decode((await loads.next_msg(timeout=max(0.1, deadline - time.monotonic()))).data, ExpertLoad)
            if load.phy2log:
                break
        rows = len(load.layer_ids)
        target = every_expert_moves(tensor_from(load.phy2log, rows), world)
        ask = RebalanceRequest(instance, tensor_bytes(target), rows)

        async def move() -> RebalanceReply:
            while True:  # a balancer that has not heard from every rank yet says so
                reply = await request(nc, s.eplb(instance, "rebalance"), ask, RebalanceReply, timeout_s)
                if reply.ok or "has not reported" not in reply.error or time.monotonic() > deadline:
                    return reply
                await asyncio.sleep(0.2)

        mover = asyncio.create_task(move())
        ranks: set[int] = set()
        try:
            while len(ranks) < world:
                if mover.done() and not mover.exception() and not mover.result().ok:
                    raise RuntimeError(f"the balancer refused the move: {mover.result().error}")
                try:
                    m = decode((await staged.next_msg(timeout=0.5)).data, MoveStaged)
                except nats.errors.TimeoutError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the ranks never staged the move (staged: {sorted(ranks)})") from None
                    continue
                if not m.ok:
                    raise RuntimeError(f"rank {m.rank} could not stage the move: {m.error}")
                ranks.add(m.rank)
            kill()
            at = time.time()
        finally:
            mover.cancel()
        return at
    finally:
        await nc.close()


def judge(log_dir: Path, ranks: list[str], balancer_killed: bool, wait_s: float) -> dict:
    """After a cut move: which ranks switched (none may) and which dropped the staged move
    (with the balancer killed, every rank must, within wait_s)."""
    def text(name: str) -> str:
        p = log_dir / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    deadline = time.monotonic() + wait_s
    while balancer_killed and not all(DROPPED in text(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.25)
    return {"ranks": ranks, "switched": [r for r in ranks if SWITCHED in text(r)],
            "dropped": [r for r in ranks if DROPPED in text(r)], "must_drop": balancer_killed}


def move_goal(move: dict) -> list[str]:
    """Pure: what a cut move's outcome misses."""
    missed = []
    if move["switched"]:
        missed.append(f"switched: {', '.join(move['switched'])}")
    if move["must_drop"] and len(move["dropped"]) < len(move["ranks"]):
        missed.append("a rank kept the staged move")
    return missed
