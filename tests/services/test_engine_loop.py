"""The engine loop's operations once it has stopped: a task that gives blocks back while
its service closes must not wait for a step that will never come."""

from __future__ import annotations

import asyncio

import pytest

from moemesh.shared.service.engine_loop import EngineLoop


@pytest.mark.parametrize("spec,overlap", [(1, False), (1, True), (0, True)],
                         ids=["whole-steps", "mtp-planned-steps", "planned-steps"])
def test_operations_after_the_loop_stops_still_run(tiny_engine_factory, spec, overlap):
    engine = tiny_engine_factory(num_speculative_tokens=spec, overlap_mtp=overlap)
    assert engine.can_overlap == overlap

    async def go():
        loop = EngineLoop(engine, lambda out, stats: None)
        task = asyncio.create_task(loop.run())
        await asyncio.sleep(0.05)
        loop.stop()
        queued = loop.submit(lambda e: e.blocks.num_free_blocks)  # may be queued for a next step
        await asyncio.wait_for(task, 5)
        late = await asyncio.wait_for(loop.call(lambda e: "late"), 5)
        return await asyncio.wait_for(queued, 5), late

    free, late = asyncio.run(go())
    assert free == engine.blocks.num_blocks and late == "late"


class _OneRank:
    """The agreement of an instance of one rank: its own values are everyone's, at once."""

    def start_exchange(self, values: list[int]):
        return _Done([values])


class _Done:
    def __init__(self, values):
        self.values = values

    def done(self) -> bool:
        return True

    def result(self):
        return self.values


@pytest.mark.parametrize("lockstep", [False, True], ids=["one-worker", "lockstep-rank"])
@pytest.mark.parametrize("arriving", [False, True], ids=["planned-at-once", "planned-late"])
def test_a_request_arriving_mid_step_joins_the_next_step_when_planned_late(tiny_model, arriving, lockstep):
    """While requests come in (a decode worker's hand-offs), the step after the running one
    is planned near the running one's end, so a request that arrives meanwhile runs in
    that next step; planned at once, it waits a whole step more. B is added from the
    loop's own wait (scheduled when the loop asks whether requests are coming, while the
    second step runs), so the order does not depend on how fast this machine is. A DEP
    rank's loop (its steps agreed with the other ranks') plans late the same way."""
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.engine.mock_model import MockModel
    from moemesh.shared.model.config import ModelConfig
    from moemesh.shared.protocol.messages import SamplingParams
    from moemesh.shared.service.lockstep import Lockstep

    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=64, max_num_seqs=4),
                       model=MockModel(ModelConfig.from_dir(tiny_model), 0.1), lockstep=lockstep)
    assert engine.can_overlap
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    steps: list[list[str]] = []

    async def go():
        done = asyncio.Event()
        loop: EngineLoop | None = None
        asked = 0

        def b_arrives() -> None:  # at the loop's next wait
            asyncio.get_running_loop().call_soon(lambda: loop.submit(lambda e: e.add_request("B", [7, 8, 9], params)))

        async def on_outputs(out, stats):
            steps.append(list(out.request_ids))
            if len(steps) == 1 and not arriving:  # the second step runs from the loop's next wait on
                b_arrives()
            if not engine.has_unfinished():
                done.set()

        def coming() -> bool:
            nonlocal asked
            asked += 1
            if asked == 2:  # the first step has landed, the second runs: the loop waits to plan the third
                b_arrives()
            return True

        loop = EngineLoop(engine, on_outputs,
                          lockstep=Lockstep(_OneRank(), lambda: 0, lambda: None) if lockstep else None)
        if arriving:
            loop.arriving = coming
        engine.add_request("A", [1, 2, 3, 4], params)
        task = asyncio.create_task(loop.run())
        await asyncio.wait_for(done.wait(), 30)
        loop.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    first_b = next(i for i, rows in enumerate(steps) if "B" in rows)
    assert first_b == (2 if arriving else 3), steps


def test_the_late_plan_margin_grows_with_late_wake_ups_and_never_passes_half_a_step():
    from moemesh.shared.service.engine_loop import JOIN_MARGIN_S

    loop = EngineLoop(None, lambda out, stats: None)
    loop._device_ewma_s = 0.005
    assert loop._join_margin_s() == JOIN_MARGIN_S  # wake-ups on time: the base margin
    loop._plan_ewma_s = 0.001
    assert loop._join_margin_s() == pytest.approx(0.002)  # twice the planning time
    loop._late_peak_s = 0.001
    assert loop._join_margin_s() == pytest.approx(JOIN_MARGIN_S / 2 + 0.0015)  # room for waking as late as lately
    loop._late_peak_s = 0.004
    assert loop._join_margin_s() == pytest.approx(0.0025)  # at most half the step: planned no earlier than mid-step


def test_retried_operations_go_by_class_then_submission():
    """A decode worker's imports that wait for blocks: those a step frees go to the best
    class's oldest waiter first, whatever order they were submitted in."""
    class Engine:
        free = 0

    engine, taken = Engine(), []

    def importer(name: str):
        def attempt(e) -> bool:
            if not e.free:
                return False
            e.free -= 1
            taken.append(name)
            return True
        return attempt

    loop = EngineLoop(engine, lambda out, stats: None)
    for name, priority in (("low-a", 0), ("low-b", 0), ("high", -1), ("worst", 3), ("high-2", -1)):
        loop.retry_each_step(importer(name), priority)
    loop._apply_ops()
    assert taken == [] and len(loop.pending_retry) == 5
    for _ in range(5):  # one block frees per step
        engine.free = 1
        loop._apply_ops()
    assert taken == ["high", "high-2", "low-a", "low-b", "worst"] and not loop.pending_retry
    loop._pool.shutdown()
