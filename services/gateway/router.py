"""Which decode worker gets a new request.

Rule: the live worker with the least outstanding token load, where load is what its
last heartbeat reported plus what this gateway has sent it since. The second term
keeps a burst of requests from all landing on the worker that looked idle a moment
ago. Ties go to the worker with more free KV blocks. Keeping DP ranks at equal token
load keeps them in step.
"""

from __future__ import annotations

from shared.protocol.messages import Heartbeat


def pick_decode(workers: list[Heartbeat], assigned_since_beat: dict[str, int]) -> Heartbeat | None:
    if not workers:
        return None
    return min(
        workers,
        key=lambda w: (w.load.outstanding_tokens + assigned_since_beat.get(w.worker_id, 0),
                       -w.load.num_free_blocks, w.worker_id),
    )
