"""Background tasks that one component owns.

asyncio keeps only a weak reference to a task: one nobody holds can be collected
mid-flight, and its exception is reported late or never. A TaskSet holds each task
until it is done, logs a crash under the task's name, and on close lets what is
running finish for a grace period before it cancels the rest.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Coroutine

log = logging.getLogger(__name__)


class TaskSet:
    def __init__(self):
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task | None:
        """Run coro as a tracked task; None (and coro is dropped) once the set is closed."""
        if self._closed:
            coro.close()
            log.debug("task %s not started: shutting down", name)
            return None
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._done)
        return t

    def _done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("background task %s crashed", t.get_name(), exc_info=t.exception())

    async def close(self, grace_s: float = 0.0) -> None:
        """Refuse new tasks, wait up to grace_s for the running ones, cancel the rest.
        Safe to call twice."""
        self._closed = True
        tasks = list(self._tasks)
        if tasks and grace_s > 0:
            _, tasks = await asyncio.wait(tasks, timeout=grace_s)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
