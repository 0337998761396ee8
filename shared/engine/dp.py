"""The lockstep group of a DEP instance's ranks.

Every step the ranks exchange a few integers (who has work, which staged expert move
is ready) in one small all-gather, so all of them decide the same thing at the same
step boundary: to run a step (the idle ones with an empty batch), or to switch to a
new expert placement. Collectives time out, so a dead peer ends the instance instead
of hanging it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class DPGroup:
    def __init__(self, rank: int, size: int, init_method: str, device: str = "cpu", timeout_s: float = 60.0):
        self.rank, self.size = rank, size
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        # The agreement's own connections: it runs beside a step's all-to-alls (engine_loop),
        # and two collectives at once on one group would interleave their messages. Its own
        # timeout too: a new group's default is gloo's 30 minutes, not the one given above,
        # and a peer that stopped answering would hold this rank that long.
        self.ctrl_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def exchange(self, values: list[int]) -> list[list[int]]:
        """All-gather a short int vector; returns every rank's values, by rank."""
        return self.start_exchange(values).result()

    def start_exchange(self, values: list[int]) -> "PendingExchange":
        """exchange(), started: gloo's own worker runs it while the caller goes on, so a
        caller that asks once it is done (as the engine loop does, a step later) needs no
        thread of its own, nor a wake-up to hear of it."""
        mine = torch.tensor(values, dtype=torch.long)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        return PendingExchange(dist.all_gather(out, mine, group=self.ctrl_group, async_op=True), out)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class PendingExchange:
    def __init__(self, work, out: list[torch.Tensor]):
        self._work, self._out = work, out

    def done(self) -> bool:
        return self._work.is_completed()

    def result(self) -> list[list[int]]:
        """Every rank's values, by rank; blocks until they are in (at most the group's
        timeout: a dead peer raises)."""
        self._work.wait()
        return [t.tolist() for t in self._out]
