"""Carrying out one expert move across the ranks of an instance.

plan (published to every rank) -> every rank staged, or any failed -> commit (or
abort) -> every rank done. Each wait has a timeout; on any failure or timeout the
move is aborted and the old placement, untouched on every rank, stays in force.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from moemesh.shared.protocol.messages import MoveAbort, MoveCommit, MoveDone, MovePlan, MoveStaged
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.dep_runtime import tensor_bytes
from moemesh.shared.service.nats_io import publish

log = logging.getLogger(__name__)
_ids = itertools.count(int(time.time()) & 0xFFFF)


@dataclass
class MoveResult:
    ok: bool
    move_id: int
    error: str = ""
    seconds: float = 0.0
    staged_seconds: float = 0.0
    bytes_moved: int = 0
    version: int = -1  # the placement version the ranks switched to


class MoveCoordinator:
    def __init__(self, nc, subjects: Subjects, timeout_s: float, commit_delay_s: float = 0.0):
        """commit_delay_s: fault injection (debug_commit_delay_s): a pause between every
        rank having staged and the commit, where a test cuts the move."""
        self.nc, self.subjects, self.timeout_s, self.commit_delay_s = nc, subjects, timeout_s, commit_delay_s
        self._staged: dict[tuple[str, int], dict[int, MoveStaged]] = {}
        self._done: dict[tuple[str, int], dict[int, MoveDone]] = {}
        self._events: dict[tuple[str, int], asyncio.Event] = {}

    def on_staged(self, m: MoveStaged) -> None:
        key = (m.instance_id, m.move_id)
        if key in self._staged:
            self._staged[key][m.rank] = m
            self._events[key].set()

    def on_done(self, m: MoveDone) -> None:
        key = (m.instance_id, m.move_id)
        if key in self._done:
            self._done[key][m.rank] = m
            self._events[key].set()

    async def _wait(self, key, table: dict, n: int, deadline: float, stop_on_failure: bool = False) -> bool:
        """Until n ranks answered (True), a rank failed (True, when asked), or the deadline (False)."""
        while len(table[key]) < n:
            if stop_on_failure and any(not m.ok for m in table[key].values()):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._events[key].clear()
            try:
                await asyncio.wait_for(self._events[key].wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    async def move(self, instance: str, dp_size: int, base_version: int, new: torch.Tensor) -> MoveResult:
        move_id = next(_ids)
        key = (instance, move_id)
        self._staged[key], self._done[key], self._events[key] = {}, {}, asyncio.Event()
        t0 = time.monotonic()
        try:
            plan = MovePlan(instance, move_id, tensor_bytes(new), new.shape[0], base_version, self.timeout_s)
            await publish(self.nc, self.subjects.eplb(instance, "plan"), plan)
            deadline = t0 + self.timeout_s
            if not await self._wait(key, self._staged, dp_size, deadline, stop_on_failure=True):
                return await self._abort(instance, move_id, f"only {len(self._staged[key])}/{dp_size} ranks staged in time")
            failed = [s for s in self._staged[key].values() if not s.ok]
            if failed:
                return await self._abort(instance, move_id, f"rank {failed[0].rank}: {failed[0].error}")
            staged_s = time.monotonic() - t0
            if self.commit_delay_s:
                log.warning("FAULT INJECTION: move %d waits %.1fs before its commit", move_id, self.commit_delay_s)
                await asyncio.sleep(min(self.commit_delay_s, max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    # The ranks drop a staged move at its deadline: a commit now could reach
                    # one rank before it dropped and the other after. Abort instead, and a
                    # balancer told to stop is not held for the rest of the delay.
                    return await self._abort(instance, move_id, "the commit was held past the move's deadline")
            await publish(self.nc, self.subjects.eplb(instance, "commit"), MoveCommit(instance, move_id))
            if not await self._wait(key, self._done, dp_size, deadline):
                # Ranks switch together or not at all (lockstep); an abort now is safe either way.
                return await self._abort(instance, move_id, "not every rank switched in time")
            moved = sum(s.bytes_received for s in self._staged[key].values())
            version = max(d.placement_version for d in self._done[key].values())
            return MoveResult(True, move_id, seconds=time.monotonic() - t0, staged_seconds=staged_s,
                              bytes_moved=moved, version=version)
        finally:
            for table in (self._staged, self._done, self._events):
                table.pop(key, None)

    async def _abort(self, instance: str, move_id: int, why: str) -> MoveResult:
        await publish(self.nc, self.subjects.eplb(instance, "abort"), MoveAbort(instance, move_id, why))
        return MoveResult(False, move_id, error=why)
