"""The engine loop's operations once it has stopped: a task that gives blocks back while
its service closes must not wait for a step that will never come."""

from __future__ import annotations

import asyncio

import pytest

from moemesh.shared.service.engine_loop import EngineLoop


@pytest.mark.parametrize("spec", [1, 0], ids=["whole-steps", "planned-steps"])
def test_operations_after_the_loop_stops_still_run(tiny_engine_factory, spec):
    engine = tiny_engine_factory(num_speculative_tokens=spec)
    assert engine.can_overlap == (spec == 0)

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


@pytest.mark.parametrize("beside", [False, True], ids=["publish-after", "publish-beside"])
def test_whole_steps_publish_every_output_once_in_order(tiny_model, beside):
    """MTP drafts (whole steps): with publish_beside a step's outputs go out while the next
    step runs; every token still goes out once, in order, the last step's too."""
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.engine.mock_model import MockModel
    from moemesh.shared.model.config import ModelConfig
    from moemesh.shared.protocol.sampling import SamplingParams

    def engine():
        mock = MockModel(ModelConfig.from_dir(tiny_model), 0.002, accept_rate=0.7)
        return LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=256, num_speculative_tokens=2), model=mock)

    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = engine()
    for i in range(5):
        ref.add_request(f"r{i}", [0, 5 + i, 6], p)
    want: dict[str, list[int]] = {}
    while ref.has_unfinished():
        for o in ref.step():
            want.setdefault(o.request_id, []).extend(o.new_token_ids)

    eng = engine()
    assert not eng.can_overlap
    got: dict[str, list[int]] = {}
    finished: list[str] = []

    async def on_outputs(out, stats):
        for rid, ids in out.rows():
            got.setdefault(rid, []).extend(ids)
        finished.extend(out.request_ids[e.row] for e in out.extras if e.finish_reason is not None)

    async def go():
        loop = EngineLoop(eng, on_outputs, publish_beside=beside)
        task = asyncio.create_task(loop.run())
        for i in range(5):
            await loop.call(lambda e, i=i: e.add_request(f"r{i}", [0, 5 + i, 6], p))
        for _ in range(500):
            if len(finished) == 5:
                break
            await asyncio.sleep(0.01)
        loop.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    assert got == want and sorted(finished) == [f"r{i}" for i in range(5)]
