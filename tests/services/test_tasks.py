import asyncio
import logging

from moemesh.shared.service.tasks import TaskSet


def test_tasks_are_held_crashes_logged_and_the_rest_cancelled_on_close(caplog):
    async def main():
        ts = TaskSet()
        forever = ts.spawn(asyncio.sleep(3600), "forever")
        quick = ts.spawn(asyncio.sleep(0.01), "quick")

        async def boom():
            raise RuntimeError("boom")

        crashed = ts.spawn(boom(), "boom")
        await asyncio.wait([quick, crashed])
        await asyncio.sleep(0)  # their done callbacks, whatever the order they were queued in
        assert len(ts) == 1 and quick.done()  # finished ones are let go
        await ts.close(grace_s=0.05)
        assert forever.cancelled() and len(ts) == 0
        assert ts.spawn(asyncio.sleep(0), "late") is None  # closed: refused, and the coroutine closed
        await ts.close()  # twice is fine

    with caplog.at_level(logging.ERROR, logger="moemesh.shared.service.tasks"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == ["background task boom crashed"]
