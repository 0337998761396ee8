"""The balancer's move coordinator against a real NATS server, with the ranks' side
played by the test: a commit held back past the move's deadline (debug_commit_delay_s)
never goes out; the move aborts at its deadline instead."""

from __future__ import annotations

import asyncio

import nats

from moemesh.services.balancer.mover import MoveCoordinator
from moemesh.shared.model.expert_parallel import start_phy2log
from moemesh.shared.protocol.messages import MoveAbort, MoveCommit, MovePlan, MoveStaged, decode
from moemesh.shared.protocol.subjects import Subjects


def test_a_commit_held_past_the_deadline_aborts_the_move_there(nats_url):
    async def go():
        nc = await nats.connect(nats_url)
        s = Subjects()
        seen: list[tuple[str, object]] = []
        mover = MoveCoordinator(nc, s, timeout_s=1.0, commit_delay_s=60.0)

        async def on_plan(msg):  # both ranks stage the plan at once
            plan = decode(msg.data, MovePlan)
            seen.append(("plan", plan))
            for rank in (0, 1):
                mover.on_staged(MoveStaged(plan.instance_id, plan.move_id, rank, True))

        async def on(kind, cls):
            async def cb(msg):
                seen.append((kind, decode(msg.data, cls)))
            await nc.subscribe(s.eplb("i", kind), cb=cb)

        await nc.subscribe(s.eplb("i", "plan"), cb=on_plan)
        await on("commit", MoveCommit)
        await on("abort", MoveAbort)
        await nc.flush()
        new = start_phy2log(8, 2, 0).repeat(2, 1).flip(1).contiguous()
        # Bounded far below the 60 s delay: the move ends at its 1 s deadline.
        res = await asyncio.wait_for(mover.move("i", 2, 0, new), 15)
        await nc.flush()
        await asyncio.sleep(0.1)
        await nc.close()
        return res, seen

    res, seen = asyncio.run(go())
    assert not res.ok and "deadline" in res.error
    kinds = [k for k, _ in seen]
    assert kinds == ["plan", "abort"], kinds  # no commit ever went out
    assert seen[1][1].move_id == seen[0][1].move_id
