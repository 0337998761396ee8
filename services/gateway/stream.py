"""Turning one request's token updates into text events: incremental detokenization,
stop strings, finish reasons, and the inactivity timeout."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from services.gateway.mesh_client import Handle, MeshClient
from services.gateway.openai_api import GenerateRequest
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.tokenizer import Tokenizer


@dataclass
class Event:
    text: str = ""
    finish: str | None = None  # stop | length | abort | error
    error: str | None = None
    logprobs: list = field(default_factory=list)
    num_tokens: int = 0  # tokens that arrived with this event


async def events(mesh: MeshClient, tok: Tokenizer, req: GenerateRequest, handle: Handle,
                 inactivity_timeout_s: float) -> AsyncIterator[Event]:
    detok = IncrementalDetokenizer(tok, req.params.stop)
    while True:
        try:
            u = await asyncio.wait_for(handle.queue.get(), inactivity_timeout_s)
        except asyncio.TimeoutError:
            await mesh.abort(req.request_id, "timeout")
            yield Event(finish="error", error=f"no tokens for {inactivity_timeout_s:.0f}s; request aborted")
            return
        if u.error:
            mesh.finish(req.request_id)
            yield Event(finish="error", error=u.error)
            return
        text = detok.add(u.token_ids)
        lps = _as_logprobs(u.logprobs)
        if detok.stopped:
            if u.finish_reason is None:
                await mesh.abort(req.request_id, "stop_string")  # the workers keep going otherwise
            else:
                mesh.finish(req.request_id)
            yield Event(text, "stop", logprobs=lps, num_tokens=len(u.token_ids))
            return
        if u.finish_reason is not None:
            mesh.finish(req.request_id)
            yield Event(text + detok.flush(), u.finish_reason, logprobs=lps, num_tokens=len(u.token_ids))
            return
        if text or lps or u.token_ids:
            yield Event(text, logprobs=lps, num_tokens=len(u.token_ids))


@dataclass
class _LP:
    token_id: int
    logprob: float
    top: list


def _as_logprobs(wire) -> list:
    if not wire:
        return []
    return [_LP(w.token_id, w.logprob, [(int(t), v) for t, v in w.top]) for w in wire]
