"""Which decode worker gets a new request.

Rule: the live worker with the least outstanding token load, where load is what its
last heartbeat reported plus what this gateway has sent it since. The second term
keeps a burst of requests from all landing on the worker that looked idle a moment
ago. Ties go to the worker with more free KV blocks. Keeping DP ranks at equal token
load keeps them in step.
"""

from __future__ import annotations

from moemesh.shared.protocol.messages import Heartbeat


def pick_decode(workers: list[Heartbeat], assigned_since_beat: dict[str, int]) -> Heartbeat | None:
    if not workers:
        return None
    return min(
        workers,
        key=lambda w: (w.load.outstanding_tokens + assigned_since_beat.get(w.worker_id, 0),
                       -w.load.num_free_blocks, w.worker_id),
    )


def pick_prefill(workers: list[Heartbeat], overlap: dict[str, int], block_size: int,
                 assigned_since_beat: dict[str, int], load_weight: float = 1.0) -> Heartbeat | None:
    """KV-aware choice of a prefill worker.

    Rule: maximise  cached_tokens(w) - load_weight * queued_prompt_tokens(w),
    where cached_tokens is the prompt prefix the worker already holds (blocks times
    block size) and queued_prompt_tokens is what its last heartbeat reported still to
    prefill plus what this gateway sent it since. A cached token saves exactly the work
    a queued token costs, so with load_weight 1 a request goes where its context lives
    unless that worker is busier by more than the context is long: requests of one
    session return to the worker that holds their growing prefix, and load still spreads.
    """
    if not workers:
        return None

    def score(w: Heartbeat) -> tuple:
        queued = w.load.pending_prompt_tokens + assigned_since_beat.get(w.worker_id, 0)
        return (overlap.get(w.worker_id, 0) * block_size - load_weight * queued, -queued, w.worker_id)

    return max(workers, key=score)
