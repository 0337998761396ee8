"""A job delivered twice. When the gateway's request for a job times out it sends the job
again, to the prefill queue group; across a NATS outage both copies wait in its client's
buffer and both arrive when the link is back (moemesh bench chaos, nats-10s). The
request must then be served once and end normally, whichever workers the copies reach."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import nats

from moemesh.services.decode.config import DecodeConfig
from moemesh.services.decode.service import DecodeService
from moemesh.services.prefill.config import PrefillConfig
from moemesh.services.prefill.service import PrefillService
from moemesh.shared.protocol.messages import Ack, PrefillJob, SamplingParams, TokenBatch, WireSampling, decode
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.nats_io import request
from moemesh.shared.transport.loopback import LoopbackHub, LoopbackTransport
from tests.services.test_in_process import _wait_free, mesh

_prefixes = iter(range(1_000_000))


def _job(rid: str, gateway: str) -> PrefillJob:
    wire = WireSampling.from_params(SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    return PrefillJob(rid, list(range(1, 40)), wire, gateway, "decode-r")


def test_both_copies_on_one_worker_run_once_and_are_both_acknowledged(nats_url, tiny_model, tmp_path):
    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=100.0) as m:
            s = Subjects(m.prefix)
            nc = await nats.connect(nats_url)
            try:
                job = _job("twice", "gw-t")
                job.decode_id = "decode-t"
                acks = await asyncio.gather(request(nc, s.prefill_direct("prefill-t"), job, Ack, 5),
                                            request(nc, s.prefill_jobs, job, Ack, 5))
                assert [a.worker_id for a in acks] == ["prefill-t", "prefill-t"]
                await _wait_free(m)
                assert m.prefill.rt.engine.num_prompt_tokens_total == len(job.prompt_ids)  # prefilled once
            finally:
                await nc.close()

    asyncio.run(go())


def test_copies_on_two_workers_end_the_request_normally(nats_url, tiny_model):
    """Both prefill workers compute it and offer the decode worker its KV: the decode
    worker takes the first offer, and the prefill worker whose offer came second lets its
    copy go without failing the request."""
    async def go() -> list:
        prefix, hub = f"rep{next(_prefixes)}", LoopbackHub()
        s = Subjects(prefix)
        common = dict(nats_url=nats_url, model=tiny_model, subject_prefix=prefix, served_model_name="tiny",
                      heartbeat_interval_s=0.25, staging_mb=16, num_kv_blocks=256, engine="mock", mock_step_ms=20.0)
        async with AsyncExitStack() as stack:
            pres = [await stack.enter_async_context(PrefillService(PrefillConfig(worker_id=w, **common), None,
                                                                     lambda: LoopbackTransport(hub)))
                    for w in ("prefill-a", "prefill-b")]
            dec = await stack.enter_async_context(DecodeService(DecodeConfig(worker_id="decode-r", **common), None,
                                                                lambda: LoopbackTransport(hub)))
            nc = await nats.connect(nats_url)
            ends = []
            done = asyncio.Event()

            async def on_tokens(msg):
                b = decode(msg.data, TokenBatch)
                for e in b.ends:
                    if b.request_ids[e.row] == "dup":
                        ends.append((b.worker_id, e.finish_reason, e.error))
                        if e.finish_reason is not None and (e.error or b.worker_id == "decode-r"):
                            done.set()

            try:
                await nc.subscribe(s.gateway_tokens("gw-r", "*"), cb=on_tokens)
                deadline = time.monotonic() + 10  # until the prefill workers have heard the decode worker's heartbeat
                while not all(p.peers.live("decode") for p in pres):
                    assert time.monotonic() < deadline, "no decode heartbeat heard"
                    await asyncio.sleep(0.02)
                job = _job("dup", "gw-r")
                await asyncio.gather(request(nc, s.prefill_direct("prefill-a"), job, Ack, 5),
                                     request(nc, s.prefill_direct("prefill-b"), job, Ack, 5))
                await asyncio.wait_for(done.wait(), 10)
                await asyncio.sleep(0.3)  # a late error end would show now
                assert "dup" not in dec.active
            finally:
                await nc.close()
            return ends

    ends = asyncio.run(go())
    assert [e for e in ends if e[2] is not None] == []
    assert ("decode-r", "length", None) in ends
