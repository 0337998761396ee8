"""Drives an LLMEngine from asyncio.

The device part of a step (forward, logits, sampling) runs on one worker thread, so the
event loop keeps serving NATS and UCX while the model computes. Everything else touches
the engine from the loop, between its own awaits: NATS handlers and KV transfers submit
operations that run there.

When the engine takes planned steps (not a lockstep rank; with MTP drafts, the steps
spec_overlap.py takes), the loop overlaps the host with the device:

    plan N+1, queue it  ->  wait for N  ->  land N, publish N's tokens
    (host, while N runs)    (N+1 starts    (host, while N+1 runs)
                             as N ends)

so the device waits only for what cannot be done earlier. Otherwise (and for an MTP step
spec_overlap does not take) a step runs whole on the thread and the host work sits
between steps.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import operator
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

import torch

from moemesh.shared.engine.engine import BLOCKED, LLMEngine
from moemesh.shared.engine.spec_overlap import WHOLE
from moemesh.shared.engine.outputs import StepOutputs, StepStats
from moemesh.shared.engine.planned_step import PlannedStep

log = logging.getLogger(__name__)

# While requests come in, the next step is planned at least this long before the running one
# is due to end (more for slow planning or late wake-ups: EngineLoop._join_margin_s): an
# event loop's timer may fire up to a millisecond late.
JOIN_MARGIN_S = 0.0015

Op = Callable[[LLMEngine], Any]
OutputSink = Callable[[StepOutputs, StepStats], Awaitable[None]]


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_outputs: OutputSink, idle_poll_s: float = 0.5, lockstep=None):
        """lockstep: a Lockstep when this engine is one rank of a DEP instance."""
        self.engine = engine
        self.lockstep = lockstep
        self._on_outputs = on_outputs
        self._ops: list[tuple[Op, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._ended = False  # run() has returned: no step will run again
        self._idle_poll_s = idle_poll_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        # Attempts still to succeed, by (class, submission): the best class's oldest goes first.
        self.pending_retry: list[tuple[tuple[int, int], Callable[[LLMEngine], bool]]] = []
        self._retries = itertools.count()
        self.after_ops: Callable[[bool], None] | None = None  # e.g. refresh a load snapshot (force: bool)
        self.after_step: Callable[[], None] | None = None  # the worker's bookkeeping of every step
        self.last_gap_s = 0.0  # loop time between the previous step's end and this step's start
        self._step_end: float | None = None
        self._ops_s = 0.0  # host time applying operations since the last step was accounted
        self._immediate = False  # ops run as submitted (planned steps), not between steps
        self._publish_s = 0.0  # host time publishing the previous step's outputs
        # Whether requests are coming in (a decode worker's hand-offs): then the step after
        # the running one is planned late, for them to join it (_await_joiners). None: never.
        self.arriving: Callable[[], bool] | None = None
        self._device_ewma_s = 0.0  # recent planned steps' device time
        self._plan_ewma_s = 0.0  # recent time to plan a step
        self._late_peak_s = 0.0  # how late the loop's recent wake-ups for a late plan were (a decaying peak)

    def submit(self, op: Op) -> asyncio.Future:
        """Run op(engine); the future gets its result or exception. With planned steps the
        engine is only ever touched from the event loop (the device thread keeps to its
        step's own tensors), so the op runs at once. Otherwise it runs between steps."""
        if self._ended:
            return self._after_end(op)
        fut = asyncio.get_running_loop().create_future()
        if self._immediate:
            t = time.perf_counter()
            _settle(fut, op, self.engine)
            self._ops_s += time.perf_counter() - t
            if self.after_ops is not None:
                self.after_ops(False)
        else:
            self._ops.append((op, fut))
        self._wake.set()
        return fut

    async def call(self, op: Op) -> Any:
        return await self.submit(op)

    def post(self, op: Op, what: str) -> asyncio.Future:
        """submit(), for a caller that does not wait: a failure is logged, never lost."""
        fut = self.submit(op)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                              or log.error("%s failed: %s", what, f.exception()))
        return fut

    def retry_each_step(self, attempt: Callable[[LLMEngine], bool], priority: int = 0) -> None:
        """attempt(engine) runs until it returns True (e.g. waits for blocks): at once when
        ops run as submitted, then before every step, in order of priority (the request's
        class, lower first) and then of submission, so that the blocks a step frees go to
        the best class's oldest waiter."""
        if self._immediate and _safe(attempt, self.engine):
            self._wake.set()
            return
        bisect.insort(self.pending_retry, ((priority, next(self._retries)), attempt), key=operator.itemgetter(0))
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
        try:
            if self.lockstep is not None and self.engine.can_overlap:
                await self._run_lockstep_planned()
            elif self.lockstep is not None:
                await self._run_lockstep()
            elif self.engine.can_overlap:
                self._immediate = True
                await self._run_overlapped()
            else:
                await self._run_whole_steps()
        finally:
            self._ended = True
            ops, self._ops = self._ops, []
            for op, fut in ops:
                if not fut.done():
                    self._after_end(op).add_done_callback(lambda f, fut=fut: _copy_outcome(f, fut))

    def _after_end(self, op: Op) -> asyncio.Future:
        """An op once no step will run again (e.g. a task giving blocks back as the service
        closes): on the step thread, so it runs after a step that may still be finishing
        there, and never waits for a step that will not come."""
        return asyncio.wrap_future(self._pool.submit(op, self.engine))

    def shutdown(self) -> None:
        """Let the step thread go once the service's tasks are done with the engine (their
        last ops run there, _after_end); a step still finishing there ends first."""
        self._pool.shutdown(wait=False)

    async def _idle(self, timeout: float) -> None:
        self._step_end = None  # the next gap is waiting for work, not host overhead
        self._wake.clear()
        if self._ops:  # retries alone wait for a wake (an op, or a freed block)
            return
        if self.after_ops is not None:
            self.after_ops(True)  # the snapshot an idle worker reports must be exact
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # ---- planned steps, overlapped -----------------------------------------------------
    async def _run_overlapped(self) -> None:
        """Each round: plan the next step and queue it on the device thread (it starts the
        moment the running one ends), then wait for the oldest step and land it. At most
        two steps are out: one running, one queued behind it."""
        eng = self.engine
        loop = asyncio.get_running_loop()
        device = DeviceThread(eng.run_step, eng.device_is_async)
        out: deque[tuple[PlannedStep, asyncio.Future]] = deque()  # queued or running, oldest first
        device_end: float | None = None  # when the device finished its last step, while busy
        try:
            while not self._stopping:
                t0 = time.perf_counter()
                if len(out) == 1 and self.arriving is not None and self.arriving():
                    await self._await_joiners(device_end)
                    t0 = time.perf_counter()
                self._apply_ops()
                tp = time.perf_counter()
                plan = eng.plan_step(out[-1][0] if out else None) if len(out) < 2 else None
                if plan is not None:
                    self._plan_ewma_s += 0.2 * (time.perf_counter() - tp - self._plan_ewma_s)
                if plan is BLOCKED:  # only a preemption would make room: land first, plan again
                    plan = None
                if plan is WHOLE:  # an MTP step spec_overlap does not take (nothing is in flight)
                    device_end = None
                    await self._whole_step(loop)
                    continue
                if plan is not None:
                    eng.begin_step(plan.step_id)
                    out.append((plan, device.submit(plan)))
                    if len(out) < 2:  # the device just got work: queue the step behind it too
                        continue
                if not out:
                    device_end = None
                    await self._idle(self._idle_poll_s)
                    continue
                device_end = await self._land_oldest(out, device_end, time.perf_counter() - t0)
        finally:
            for _, fut in out:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), 5.0)  # never leave the device mid-step
                except Exception:
                    pass
            device.close()

    async def _await_joiners(self, device_end: float | None) -> None:
        """One step runs and requests are coming in: planned now, the next step would leave
        whatever lands while this one runs to the step after, a whole step later. Plan it
        as late as is safe instead: the margin before the running step is due to end,
        reckoned from when the device began it (the step before it ended) and its recent
        device time."""
        if self._device_ewma_s <= 0:
            return
        start = device_end if device_end is not None else time.perf_counter()
        wake = start + self._device_ewma_s - self._join_margin_s()
        left = wake - time.perf_counter()
        if left > 0 and not self._stopping:
            await asyncio.sleep(left)
            # On a busy host a sleeper gets its core back late, sometimes by milliseconds:
            # the margin grows with that, and shrinks back as wake-ups come on time.
            self._late_peak_s = max(time.perf_counter() - wake, 0.98 * self._late_peak_s)
        else:
            # Already late (a busy host): still let what has arrived meanwhile (callbacks
            # ready to run, hand-offs read from the socket) in before the step is planned.
            # Without this yield, whether such a request joined this step or waited a whole
            # step more depended on how loaded the host was.
            await asyncio.sleep(0)

    def _join_margin_s(self) -> float:
        """How long before the running step's end the next one is planned: room for
        planning it and for waking late, never more than half a step."""
        want = max(JOIN_MARGIN_S, 2 * self._plan_ewma_s, JOIN_MARGIN_S / 2 + 1.5 * self._late_peak_s)
        return min(want, self._device_ewma_s / 2)

    async def _land_oldest(self, out: deque, device_end: float | None, host_s: float = 0.0) -> float | None:
        """Wait for the oldest step out, land it and publish its outputs. device_end: when
        the device finished the step before it (None: it was idle since). Returns the
        same for the next step."""
        eng = self.engine
        landed, fut = out.popleft()
        await fut
        eng.end_step(landed.step_id)
        t1 = time.perf_counter()
        if landed.t_end > landed.t_start > 0:
            self._device_ewma_s += 0.2 * (landed.t_end - landed.t_start - self._device_ewma_s)
        outputs = eng.land_step(landed)
        st = landed.stats
        st.host_exposed_s = max(0.0, landed.t_start - device_end) if device_end is not None else 0.0
        # The host work of this loop round (ops, planning the next step, landing this
        # one, publishing the one before), all of it beside a running step.
        st.loop_host_s = host_s + (time.perf_counter() - t1) + self._publish_s + self._take_ops_s()
        await self._finish_step(outputs, st)
        return landed.t_end if out else None  # idle next: the next gap is not overhead

    async def _land_all(self, out: deque, device_end: float | None) -> float | None:
        while out:
            device_end = await self._land_oldest(out, device_end)
        return device_end

    async def _finish_step(self, outputs: StepOutputs, st: StepStats) -> None:
        if self.after_step is not None:
            self.after_step()
        if self.after_ops is not None:
            self.after_ops(False)
        t = time.perf_counter()
        try:
            await self._on_outputs(outputs, st)
        except Exception:
            log.exception("publishing step outputs failed")
        self._publish_s = time.perf_counter() - t

    async def _whole_step(self, loop) -> None:
        """A whole step among planned ones: it touches the whole engine on the step thread,
        so operations wait for it, as between whole steps."""
        self._immediate = False
        try:
            outs = await loop.run_in_executor(self._pool, self.engine.whole_step)
            await self._finish_step(self.engine.columns(outs), self.engine.last_stats)
        finally:
            self._immediate = True
        self._apply_ops()

    def _take_ops_s(self) -> float:
        s, self._ops_s = self._ops_s, 0.0
        return s

    # ---- whole steps (MTP drafts) -------------------------------------------------------
    async def _run_whole_steps(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._apply_ops()
            if not self.engine.has_unfinished():
                await self._idle(self._idle_poll_s)
                continue
            await self._step(loop)

    async def _step(self, loop) -> None:
        start = time.perf_counter()
        self.last_gap_s = start - self._step_end if self._step_end is not None else 0.0
        outs = await loop.run_in_executor(self._pool, self.engine.step)
        await self._finish_step(self.engine.columns(outs), self.engine.last_stats)
        self._step_end = time.perf_counter()

    async def _run_lockstep_planned(self) -> None:
        """A DEP rank whose steps are planned (planned_step.py, spec_overlap.py with MTP): the next step is queued
        on the device thread behind the running one, so the ranks' devices step back to
        back; the agreement for the boundary after a step runs beside it, as below, and
        must be in before the step after is queued. While hand-offs come in, the next step
        is planned late, as without lockstep (_await_joiners). A boundary that switches the
        placement, stops or pauses first lands every step out: the device is idle when
        experts move."""
        loop = asyncio.get_running_loop()
        ls, eng = self.lockstep, self.engine
        ctrl = ThreadPoolExecutor(1, thread_name_prefix="engine-agree")
        device = DeviceThread(eng.run_step, eng.device_is_async)
        out: deque[tuple[object, asyncio.Future]] = deque()
        device_end: float | None = None
        d = None
        self._immediate = True
        try:
            while True:
                if (len(out) == 1 and d is not None and d.run and not (d.commit or d.stop)
                        and self.arriving is not None and self.arriving()):
                    # The ranks' steps start together: one rank waking late delays them all,
                    # which the margin (from this rank's own late wake-ups) is there to cover.
                    await self._await_joiners(device_end)
                t0 = time.perf_counter()
                self._apply_ops()
                if d is None:
                    d = await _decided(ls.start(eng.has_unfinished()), ctrl)
                    ls.last_agree_s = time.perf_counter() - t0  # nothing ran beside it
                if d.commit or d.stop or not d.run:
                    device_end = await self._land_all(out, device_end)
                    if d.commit:
                        ls.switch()  # every rank does this at this same boundary, its device idle
                    if d.stop:
                        return
                    if not d.run:
                        d, device_end = None, None
                        await self._idle(ls.idle_s)
                        continue
                ls.step += 1
                plan = eng.plan_step(out[-1][0] if out else None)
                if plan is BLOCKED:  # only a preemption would make room: land first
                    device_end = await self._land_all(out, device_end)
                    plan = eng.plan_step(None)
                if plan is WHOLE:
                    device_end = await self._land_all(out, device_end)
                    nxt = ls.start(eng.has_unfinished())
                    await self._whole_step(loop)
                    device_end = None
                    d = await _decided(nxt, ctrl)
                    ls.last_agree_s = 0.0
                    continue
                if plan is None:  # no work of its own: an empty step, as every rank runs this one
                    plan = eng.empty_step()
                eng.begin_step(plan.step_id)
                out.append((plan, device.submit(plan)))
                nxt = ls.start(eng.has_unfinished())
                if len(out) == 2:
                    device_end = await self._land_oldest(out, device_end, time.perf_counter() - t0)
                d = await _decided(nxt, ctrl)
                ls.last_agree_s = 0.0  # beside the step: what the device waited for shows as exposed host
        finally:
            for _, fut in out:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), 5.0)
                except Exception:
                    pass
            device.close()
            ctrl.shutdown(wait=False)

    async def _run_lockstep(self) -> None:
        """A DEP rank. The agreement for the boundary after a step runs beside that step, as
        an asynchronous collective (on a process group of its own, apart from the step's
        all-to-alls), from this rank's state as the step starts: a rank whose last
        request ends in the step runs one empty step more, and nothing else changes: every
        rank acts on the same decisions at the same boundaries (a placement switch too).
        Only the part of the agreement the step did not cover is rank wait."""
        loop = asyncio.get_running_loop()
        ls = self.lockstep
        ctrl = ThreadPoolExecutor(1, thread_name_prefix="engine-agree")
        d = None  # the decision for this boundary, when agreed beside the step before it
        try:
            while True:
                self._apply_ops()
                if d is None:
                    t = time.perf_counter()
                    d = await _decided(ls.start(self.engine.has_unfinished()), ctrl)
                    ls.last_agree_s = time.perf_counter() - t
                if d.commit:
                    ls.switch()  # every rank does this at this same boundary
                if d.stop:
                    return
                if not d.run:
                    d = None
                    await self._idle(ls.idle_s)
                    continue
                ls.step += 1
                nxt = ls.start(self.engine.has_unfinished())
                await self._step(loop)
                t = time.perf_counter()
                d = await _decided(nxt, ctrl)
                ls.last_agree_s = time.perf_counter() - t
        finally:
            ctrl.shutdown(wait=False)

    def _apply_ops(self) -> None:
        if not self._ops and not self.pending_retry:
            return
        t = time.perf_counter()
        ops, self._ops = self._ops, []
        for op, fut in ops:
            _settle(fut, op, self.engine)
        if self.pending_retry:
            self.pending_retry = [(k, a) for k, a in self.pending_retry if not _safe(a, self.engine)]
        if ops and self.after_ops is not None:
            self.after_ops(False)
        self._ops_s += time.perf_counter() - t


class DeviceThread:
    """Runs planned steps one after another on a thread of its own, as a device stream
    would: a step queued while another runs starts the moment that one ends, without a
    round trip through the event loop.

    On an asynchronous device (a GPU, or the mock) the loop hears that step N is done
    once step N+1 has been queued on the device, not before: waking the loop costs this
    thread the GIL for as long as the loop then runs Python, and that wait belongs beside
    N+1, not between N and N+1."""

    def __init__(self, run: Callable[..., None], device_is_async: bool):
        self._run = run
        self._defer = device_is_async
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done: tuple | None = None  # a finished step not announced yet
        self._thread = threading.Thread(target=self._main, name="engine-device", daemon=True)
        self._thread.start()

    def submit(self, step: PlannedStep) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        step.queued_at = time.perf_counter()
        self._queue.put((step, fut, loop))
        return fut

    def close(self) -> None:
        """Stop after the queued steps (the caller has waited for them: this returns at once)."""
        self._queue.put(None)
        self._thread.join(timeout=1.0)

    def _announce(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            loop, fut, err = done
            loop.call_soon_threadsafe(_resolve, fut, err)

    def _main(self) -> None:
        with torch.inference_mode():
            while (item := self._queue.get()) is not None:
                step, fut, loop = item
                try:  # announces the step before this one when it is about to wait
                    self._run(step, self._announce if self._defer else None)
                    err = None
                except BaseException as e:  # handed to the loop, which owns the step
                    err = e
                self._announce()  # if the run did not (no wait, or it failed first)
                self._done = (loop, fut, err)
                if not self._defer or self._queue.empty():
                    self._announce()  # no step behind it to announce it: now
        self._announce()


async def _decided(agreement, ctrl: ThreadPoolExecutor):
    """An agreement's decision. It ran beside a step, so it is usually in by the time it is
    asked for: then it is taken at once, with no thread and no wake-up; otherwise waited
    for on ctrl, off the event loop."""
    if agreement.done():
        return agreement.result()
    return await asyncio.get_running_loop().run_in_executor(ctrl, agreement.result)


def _resolve(fut: asyncio.Future, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def _settle(fut: asyncio.Future, op: Op, engine: LLMEngine) -> None:
    try:
        res = op(engine)
    except Exception as e:
        if not fut.done():
            fut.set_exception(e)
    else:
        if not fut.done():
            fut.set_result(res)


def _safe(attempt: Callable[[LLMEngine], bool], engine: LLMEngine) -> bool:
    try:
        return bool(attempt(engine))
    except Exception:
        log.exception("retried engine operation failed; dropping it")
        return True


def _copy_outcome(src: asyncio.Future, dst: asyncio.Future) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())
