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
