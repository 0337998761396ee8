"""The background tasks a component owns: each spawned with a name, kept while it runs,
its crash logged, and all of them ended when the component closes.

A task created with a bare `create_task` and dropped is a leak twice over: the loop
holds only a weak reference to it (it may vanish mid-run, its exception reported late
or never), and nothing cancels it on close (it runs on against a closed connection, or
is destroyed pending).
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
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task | None:
        """Run coro as a tracked task; None (and coro is dropped) once the set is closing."""
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
        """Refuse new tasks, wait up to grace_s for the running ones, cancel the rest and
        wait for them to end. Safe to call twice."""
        self._closed = True
        tasks = list(self._tasks)
        if tasks and grace_s > 0:
            _, tasks = await asyncio.wait(tasks, timeout=grace_s)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> "TaskSet":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
