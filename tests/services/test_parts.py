"""The parts services are made of: tracked tasks, and the bus's concurrent handlers."""

from __future__ import annotations

import asyncio
import logging

import nats

from moemesh.shared.config.common import ServiceConfig
from moemesh.shared.protocol.messages import Ack, StatsRequest, encode
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.parts import Bus
from moemesh.shared.service.tasks import TaskSet


def test_a_task_set_keeps_live_tasks_logs_crashes_and_cancels_the_rest_on_close(caplog):
    async def go():
        done = asyncio.Event()
        async with TaskSet() as tasks:
            quick = tasks.spawn(asyncio.sleep(0), "quick")
            forever = tasks.spawn(asyncio.Event().wait(), "forever")

            async def crash():
                raise RuntimeError("boom")

            tasks.spawn(crash(), "crasher")

            async def cleanup_spawns():
                try:
                    await asyncio.Event().wait()
                finally:
                    tasks.spawn(done.wait(), "late")  # spawned while closing: cancelled too

            tasks.spawn(cleanup_spawns(), "cleanup")
            await quick
            await asyncio.sleep(0.01)
            assert len(tasks) == 2  # the finished and the crashed ones are gone
        assert forever.cancelled() and len(tasks) == 0

    with caplog.at_level(logging.ERROR):
        asyncio.run(go())
    assert any("crasher crashed" in r.getMessage() for r in caplog.records)


def test_concurrent_handlers_run_as_tasks_of_their_owner_and_stop_with_it(nats_url):
    async def go():
        tasks, s = TaskSet(), Subjects("parts")
        started = asyncio.Event()

        async def slow(req, msg, ctx):
            started.set()
            await asyncio.Event().wait()  # e.g. a transfer that never ends
            return Ack()

        async with Bus(ServiceConfig(nats_url=nats_url), "test", s, tasks) as bus:
            await bus.sub(s.stats("w"), StatsRequest, slow, concurrent=True)
            nc = await nats.connect(nats_url)
            try:
                await nc.publish(s.stats("w"), encode(StatsRequest()))
                await nc.publish(s.stats("w"), encode(StatsRequest()))
                await nc.flush()
                await asyncio.wait_for(started.wait(), 5)
                while len(tasks) < 2:  # the second did not wait behind the first
                    await asyncio.sleep(0.01)
            finally:
                await nc.close()
            await tasks.close()
            assert len(tasks) == 0

    asyncio.run(go())
