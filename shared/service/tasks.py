"""The background tasks of a service: each spawned with a name, kept while it runs, its
crash logged, and all of them cancelled and awaited when the service closes.

A task created with a bare `create_task` and dropped is a leak twice over: the loop
holds only a weak reference to it (it may vanish mid-run), and nothing cancels it on
close (it runs on against a closed connection, or is destroyed pending).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Coroutine

log = logging.getLogger(__name__)


class TaskSet:
    """Live tasks only: a task per request must not accumulate. As a part, entering does
    nothing and leaving cancels and awaits every task still running."""

    def __init__(self):
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(_log_crash)
        t.add_done_callback(self._tasks.discard)
        return t

    async def close(self) -> None:
        """Cancel every live task and wait for them to end. Safe to call twice."""
        for _ in range(3):  # a task being cancelled may spawn another (a cleanup)
            tasks = list(self._tasks)
            if not tasks:
                return
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)

    async def __aenter__(self) -> "TaskSet":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _log_crash(t: asyncio.Task) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.error("background task %s crashed", t.get_name(), exc_info=t.exception())
