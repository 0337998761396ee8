"""Drives an LLMEngine from asyncio.

The engine is touched only between steps, by this loop, or during a step, by its one
worker thread: never both at once. Everything else (NATS handlers, KV transfers)
submits operations that run between steps. The step runs in a thread so the event
loop keeps serving NATS and UCX while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from shared.engine.engine import LLMEngine, RequestOutput, StepStats

log = logging.getLogger(__name__)

Op = Callable[[LLMEngine], Any]
OutputSink = Callable[[list[RequestOutput], StepStats], Awaitable[None]]


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_outputs: OutputSink, idle_poll_s: float = 0.5, lockstep=None):
        """lockstep: a Lockstep when this engine is one rank of a DEP instance."""
        self.engine = engine
        self.lockstep = lockstep
        self._on_outputs = on_outputs
        self._ops: list[tuple[Op, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._idle_poll_s = idle_poll_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.pending_retry: list[Callable[[LLMEngine], bool]] = []
        self.num_steps = 0
        self.after_ops: Callable[[], None] | None = None  # e.g. refresh a load snapshot
        self.after_step: list[Callable[[], None]] = []  # e.g. close a load-tracking window step
        self.last_gap_s = 0.0  # loop time between the previous step's end and this step's start
        self._step_end: float | None = None

    def submit(self, op: Op) -> asyncio.Future:
        """Run op(engine) before the next step; the future gets its result or exception."""
        fut = asyncio.get_running_loop().create_future()
        self._ops.append((op, fut))
        self._wake.set()
        return fut

    async def call(self, op: Op) -> Any:
        return await self.submit(op)

    def retry_each_step(self, attempt: Callable[[LLMEngine], bool]) -> None:
        """attempt(engine) runs between steps until it returns True (e.g. waits for blocks)."""
        self.pending_retry.append(attempt)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Without lockstep: stop now. In lockstep: drain, and stop with all the ranks."""
        if self.lockstep is not None:
            self.lockstep.draining = True
        else:
            self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        if self.lockstep is not None:
            return await self._run_lockstep()
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                self._apply_ops()
                if not self.engine.has_unfinished():
                    self._step_end = None
                    self._wake.clear()
                    if self._ops:
                        continue
                    try:
                        await asyncio.wait_for(self._wake.wait(), self._idle_poll_s)
                    except asyncio.TimeoutError:
                        pass
                    continue
                await self._step(loop)
        finally:
            self._pool.shutdown(wait=False)  # a collective still blocking must not block the loop

    async def _step(self, loop) -> None:
        start = time.perf_counter()
        self.last_gap_s = start - self._step_end if self._step_end is not None else 0.0
        outputs = await loop.run_in_executor(self._pool, self.engine.step)
        self.num_steps += 1
        for fn in self.after_step:
            fn()
        if self.after_ops is not None:
            self.after_ops()
        try:
            await self._on_outputs(outputs, self.engine.last_stats)
        except Exception:
            log.exception("publishing step outputs failed")
        self._step_end = time.perf_counter()

    async def _run_lockstep(self) -> None:
        loop = asyncio.get_running_loop()
        ls = self.lockstep
        try:
            while True:
                self._apply_ops()
                d = await loop.run_in_executor(self._pool, ls.agree, self.engine.has_unfinished())
                if d.commit:
                    ls.switch()  # every rank does this at this same boundary
                if d.stop:
                    return
                if d.run:
                    ls.step += 1
                    await self._step(loop)
                    continue
                self._step_end = None  # idle: the next gap is not host overhead
                self._wake.clear()
                if not self._ops:
                    try:
                        await asyncio.wait_for(self._wake.wait(), ls.idle_s)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self._pool.shutdown(wait=False)  # a collective still blocking must not block the loop

    def _apply_ops(self) -> None:
        ops, self._ops = self._ops, []
        for op, fut in ops:
            try:
                res = op(self.engine)
            except Exception as e:
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(res)
        if self.pending_retry:
            self.pending_retry = [a for a in self.pending_retry if not _safe(a, self.engine)]
        if (ops or self.pending_retry) and self.after_ops is not None:
            self.after_ops()

def _safe(attempt: Callable[[LLMEngine], bool], engine: LLMEngine) -> bool:
    try:
        return bool(attempt(engine))
    except Exception:
        log.exception("retried engine operation failed; dropping it")
        return True
