"""Whether a message's claimed sender is the one its subject names.

A heartbeat, a token batch and a KV event each say who sent them (worker_id, holder_id),
and each travels on a subject that ends in that sender's id. NATS permissions bind a
credential to its own subjects; this check binds the payload to the subject, so a worker
that may publish only as itself cannot claim another's identity in the body either.
Pure: no I/O, nothing above the protocol.
"""

from __future__ import annotations

from typing import Any

from moemesh.shared.protocol.messages import Heartbeat, KVEvents, TokenBatch


def sender_matches(obj: Any, subject: str) -> bool:
    """True when obj names no sender, or the sender its subject names.

    Args:
        obj: a decoded message.
        subject: the subject it arrived on (any prefix, dots included).
    Returns:
        False for a Heartbeat not on `*.heartbeat.{role}.{worker_id}`, a TokenBatch not
        on `*.tokens.{worker_id}`, or a KVEvents not on `*.kv.{holder_id}.events`.
    """
    parts = subject.split(".")
    if isinstance(obj, Heartbeat):
        return parts[-3:] == ["heartbeat", obj.role, obj.worker_id]
    if isinstance(obj, TokenBatch):
        return parts[-2:] == ["tokens", obj.worker_id]
    if isinstance(obj, KVEvents):
        return parts[-3:] == ["kv", obj.holder_id, "events"]
    return True
