"""Parallel sampling (`n` > 1) on the wire: the names and settings of a request's n children.

A request of n > 1 is one PrefillJob (request id R, `n`): the prefill worker computes
its prompt once and forks it into n children, which from then on are requests of their
own everywhere (their first token, their KV hand-off, their decode, their abort and
their migration), under the ids fork_id(R, i). The gateway and the workers derive the
ids and each child's sampling settings with the functions here, so nothing per child
needs to travel with the job.
"""

from __future__ import annotations

from dataclasses import replace

from moemesh.shared.protocol.messages import INT64, SamplingParams

MAX_N = 128  # the most children a worker accepts in one job; the gateway's own bound is lower


def fork_id(request_id: str, i: int) -> str:
    return f"{request_id}-{i}"


def fork_ids(request_id: str, n: int) -> list[str]:
    return [fork_id(request_id, i) for i in range(n)]


def fork_seed(seed: int | None, i: int) -> int | None:
    """Child i's seed: seed + i, wrapped into int64 (as vLLM derives them). Child 0 keeps
    the request's own seed, so it samples what the same request with n = 1 samples, and
    the children differ from each other; each is reproducible on its own, wherever it runs
    (a migrated child goes on with the same seed)."""
    if seed is None:
        return None
    lo, hi = INT64
    return (seed + i - lo) % (hi - lo + 1) + lo


def fork_params(params: SamplingParams, i: int) -> SamplingParams:
    if params.seed is None:
        return params
    return replace(params, seed=fork_seed(params.seed, i))
