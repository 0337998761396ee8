"""The per-step agreement of a DEP instance's ranks, for the engine loop.

For every step boundary all ranks exchange (has work, draining, ready move id); the
engine loop runs the exchange for the next boundary beside the step before it. From the
same exchanged values every rank reaches the same decision: run a step (ranks with no
work run an empty one, so the MoE collectives always match), switch to a staged
expert placement (only when every rank is ready for the same move), or stop (every
rank draining and none with work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moemesh.shared.engine.dp import DPGroup


@dataclass(frozen=True)
class Decision:
    run: bool
    commit: bool
    stop: bool


def decide(values: list[list[int]]) -> Decision:
    """values: per rank [has_work, draining, ready_move_id]. Pure, so all ranks agree."""
    run = any(v[0] for v in values)
    ids = {v[2] for v in values}
    return Decision(run=run, commit=len(ids) == 1 and 0 not in ids, stop=not run and all(v[1] for v in values))


class Lockstep:
    def __init__(self, dp: DPGroup, ready_move_id: Callable[[], int], switch: Callable[[], None],
                 idle_s: float = 0.005):
        self.dp = dp
        self._ready = ready_move_id
        self._switch = switch
        self.idle_s = idle_s
        self.draining = False
        self.step = 0
        self.last_agree_s = 0.0  # the agreement's exposed part before the last step (the engine loop sets it)

    def agree(self, has_work: bool) -> Decision:
        """Blocking collective on the control group; call from one thread, in step order."""
        return self.start(has_work).result()

    def start(self, has_work: bool) -> "Agreement":
        """The agreement for the next boundary, begun from this rank's state now. Start
        them in step order, each after the one before has its result."""
        return Agreement(self.dp.start_exchange([int(has_work), int(self.draining), self._ready()]))

    def switch(self) -> None:
        self._switch()


class Agreement:
    def __init__(self, pending):
        self._pending = pending

    def done(self) -> bool:
        return self._pending.done()

    def result(self) -> Decision:
        """Blocks until every rank's values are in (bounded by the group's timeout)."""
        return decide(self._pending.result())
