"""Priority classes through the whole mesh, in one process (a real nats-server, the mock
engine): with every in-flight slot taken, a high-priority request that arrives after
low-priority ones is admitted and answered before them, and displaces the latest of them
from a full queue. Deterministic: the one slot is held by a stream that ends only when
its client leaves, every arrival waits for the queue to show it, and the order is read
from the jobs the prefill worker is sent, never from the clock."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats

from moemesh.shared.protocol.messages import PrefillJob, decode
from moemesh.shared.protocol.subjects import Subjects
from tests.services.test_in_process import _wait_free, mesh

GATEWAY = {"max_inflight": 1, "admission_queue": 3, "admission_wait_s": 120.0}


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    """Waits for a state, not for a time: the deadline only bounds a broken run."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_a_high_priority_request_overtakes_queued_low_ones(nats_url, tiny_model, tmp_path):
    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=20.0, gateway=GATEWAY) as m:
            gate = m.gateway.state.gate
            nc = await nats.connect(nats_url)
            jobs: list[tuple[str, int]] = []

            async def spy(msg):  # sees each job the gateway sends the prefill worker, in order
                job = decode(msg.data, PrefillJob)
                jobs.append((job.request_id, job.sampling.priority))

            await nc.subscribe(Subjects(m.prefix).prefill_direct("prefill-t"), cb=spy)
            await nc.flush()
            client = httpx.AsyncClient(base_url=m.url, timeout=60)
            names: dict[str, str] = {}

            async def send(name: str, priority: int | None = None, header: str | None = None) -> int:
                body = {"model": "tiny", "prompt": f"{name} asks", "max_tokens": 2, "ignore_eos": True}
                if priority is not None:
                    body["priority"] = priority
                r = await client.post("/v1/completions", json=body,
                                      headers={"x-request-priority": header} if header is not None else {})
                if r.status_code == 200:
                    names[r.json()["id"].removeprefix("cmpl-")] = name
                return r.status_code

            try:
                # The one slot: a stream far longer than the test, held until its client leaves.
                hold = {"model": "tiny", "prompt": "hold the slot", "max_tokens": 3000, "ignore_eos": True,
                        "stream": True}
                async with client.stream("POST", "/v1/completions", json=hold) as held:
                    assert held.status_code == 200
                    chunks = held.aiter_bytes()  # kept: a dropped iterator closes the stream
                    await chunks.__anext__()  # streaming: it holds the slot
                    waiting = {}
                    for k, name in enumerate(("low-1", "low-2", "low-3"), 1):
                        waiting[name] = asyncio.create_task(send(name))
                        await _until(lambda: gate.num_waiting == k, f"{name} queued")
                    # A better class takes the place of the latest low one in the full queue...
                    waiting["high"] = asyncio.create_task(send("high", priority=-1))
                    assert await waiting.pop("low-3") == 429
                    # ...by the body's field or by the header, and a low one finds no place.
                    waiting["high-2"] = asyncio.create_task(send("high-2", header="-1"))
                    assert await waiting.pop("low-2") == 429
                    assert await send("low-4", header="0") == 429
                    assert gate.num_waiting == 3 and gate.inflight == 1
                # The holder's client has gone: its slot goes to the best waiter.
                statuses = {name: await t for name, t in waiting.items()}
                await _wait_free(m)
                return statuses, jobs, names, gate.inflight, gate.num_waiting
            finally:
                await client.aclose()
                await nc.close()

    statuses, jobs, names, inflight, num_waiting = asyncio.run(go())
    assert statuses == {"low-1": 200, "high": 200, "high-2": 200}
    # Admitted, and so sent to the prefill worker, by class and then arrival; each job
    # carries its class on to the workers.
    order = [(names.get(rid, "holder"), p) for rid, p in jobs]
    assert order == [("holder", 0), ("high", -1), ("high-2", -1), ("low-1", 0)]
    assert (inflight, num_waiting) == (0, 0)


def test_a_reserve_above_the_decode_seats_seats_the_high_class_and_parks_the_low(nats_url, tiny_model, tmp_path):
    """The gateway admits one more request than the decode worker's one seat, that one for
    the better class only: a high request arriving while a low stream holds the seat is
    answered in full while the low stream is parked, and the low stream then goes on.
    The low stream is far longer than the test and ends only when its client leaves, so
    nothing depends on how long a step takes."""
    gateway = {"max_inflight": 2, "admission_reserve": 1, "admission_queue": 0}

    async def go():
        async with mesh(nats_url, tiny_model, tmp_path, engine="mock", mock_step_ms=20.0, gateway=gateway,
                        decode_only={"max_num_seqs": 1}) as m:
            client = httpx.AsyncClient(base_url=m.url, timeout=60)
            try:
                low = {"model": "tiny", "prompt": "low holds the seat", "max_tokens": 3000, "ignore_eos": True,
                       "stream": True}
                async with client.stream("POST", "/v1/completions", json=low) as held:
                    assert held.status_code == 200
                    lines = held.aiter_lines()
                    await _tokens(lines, 3)  # decoding: it holds the one seat
                    # The default class may not take the reserve...
                    other = await client.post("/v1/completions", json={"model": "tiny", "prompt": "another low",
                                                                       "max_tokens": 4})
                    # Without parking it would wait for the low stream's 3000 tokens (60 s):
                    # its own timeout says so long before.
                    high = await client.post("/v1/completions", json={
                        "model": "tiny", "prompt": "high asks", "max_tokens": 8, "ignore_eos": True,
                        "priority": -1}, timeout=20)
                    # ...and after the high request's whole answer, the low stream goes on.
                    await _tokens(lines, 3)
                return other.status_code, high.status_code, high.json()["usage"]["completion_tokens"]
            finally:
                await client.aclose()

    assert asyncio.run(go()) == (429, 200, 8)


async def _tokens(lines, n: int) -> None:
    """Reads a stream until n more chunks with text have come."""
    got = 0
    async for line in lines:
        if line.startswith("data: {"):
            got += 1
            if got == n:
                return
    raise AssertionError("the stream ended")
