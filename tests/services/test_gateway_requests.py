"""The gateway's mesh client against a real nats-server, with the workers played by
hand: where a job goes, how tokens reach the request's handle, and that a request's
end goes through its handle once."""

import asyncio

import nats
import pytest

from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.mesh.client import CLIENT_ERROR, MeshClient, Rejected
from moemesh.shared.protocol.messages import (
    Abort, Ack, ErrorReply, Heartbeat, PrefillJob, SamplingParams, TokenBatch, TokenEnd, WorkerLoad, decode, encode,
)
from moemesh.shared.protocol.subjects import Subjects

S = Subjects()


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    from moemesh.tools.launch.nats_server import NatsServerNotFound, start_nats
    from moemesh.tools.launch.procs import ProcessGroup, free_port

    group = ProcessGroup(tmp_path_factory.mktemp("nats"))
    port = free_port()
    try:
        start_nats(group, port)
    except NatsServerNotFound:
        pytest.skip("no nats-server binary")
    yield f"nats://127.0.0.1:{port}"
    group.stop()


class FakeMesh:
    """Workers as NATS subscriptions: each records what it got and acks jobs."""

    def __init__(self, nc):
        self.nc, self.jobs, self.aborts = nc, [], []

    async def ack_jobs_on(self, subject: str, who: str, queue: str = "") -> None:
        async def cb(msg):
            self.jobs.append((who, decode(msg.data, PrefillJob)))
            await msg.respond(encode(Ack()))

        await self.nc.subscribe(subject, queue=queue, cb=cb)
        await self.nc.flush()  # the server has the subscription before anything is sent to it

    async def watch_aborts(self) -> None:
        async def cb(msg):
            self.aborts.append(decode(msg.data, Abort))

        await self.nc.subscribe(S.abort, cb=cb)
        await self.nc.flush()

    async def beat(self, wid: str, role: str) -> None:
        await self.nc.publish(S.heartbeat(role, wid), encode(Heartbeat(wid, role, "m", WorkerLoad())))


async def _until(cond, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _run(nats_url, body):
    async def main():
        nc = await nats.connect(nats_url)
        mesh = MeshClient(GatewayConfig(model="m", nats_url=nats_url, prefill_timeout_s=0.5), "gw-test")
        await mesh.start()
        await mesh.nc.flush()  # its subscriptions are in place before the fake workers beat
        try:
            fake = FakeMesh(nc)
            await fake.watch_aborts()
            await body(mesh, fake)
        finally:
            await mesh.close()
            await nc.close()
        assert len(mesh._tasks) == 0  # nothing left running behind it

    asyncio.run(main())


def test_a_request_streams_to_its_handle_and_ends_once(nats_url):
    async def body(mesh, fake):
        await fake.ack_jobs_on(S.prefill_direct("p1"), "p1")
        await fake.beat("d1", "decode")
        await fake.beat("p1", "prefill")
        await _until(lambda: mesh.live("decode") and mesh.live("prefill"))
        h = await mesh.submit("r1", [1, 2, 3], SamplingParams(max_tokens=4), None)
        (who, job), = fake.jobs
        assert who == "p1" and job.decode_id == "d1" and job.gateway_id == "gw-test" and job.prompt_ids == [1, 2, 3]
        await fake.nc.publish(S.gateway_tokens("gw-test", "d1"),
                              encode(TokenBatch(["r1", "zz"], [7, 8], worker_id="d1")))
        # Claims another worker than its subject names: dropped on arrival.
        await fake.nc.publish(S.gateway_tokens("gw-test", "d1"), encode(TokenBatch(["r1"], [666], worker_id="d2")))
        await fake.nc.publish(S.gateway_tokens("gw-test", "d1"),
                              encode(TokenBatch(["r1"], [9, 10], [2], [TokenEnd(0, "length")], worker_id="d1")))
        await _until(lambda: h.finish is not None)
        assert h.take() == ([7, 9, 10], [], "length", None)
        h.close()
        assert "r1" not in mesh.handles

        h2 = await mesh.submit("r2", [1, 2], SamplingParams(max_tokens=4), None)
        h2.close("stop_string")
        h2.close("client")  # every exit path may close: only the first counts
        await _until(lambda: fake.aborts)
        await asyncio.sleep(0.05)
        assert fake.aborts == [Abort(["r2"], "stop_string")] and not mesh.handles

    _run(nats_url, body)


def test_a_job_the_chosen_worker_does_not_answer_goes_to_the_queue_group(nats_url):
    async def body(mesh, fake):
        await fake.ack_jobs_on(S.prefill_jobs, "any", queue=S.prefill_queue_group)
        await fake.beat("d1", "decode")
        await fake.beat("p-gone", "prefill")  # alive by its heartbeat, but nobody serves its subject
        await _until(lambda: mesh.live("decode") and mesh.live("prefill"))
        await mesh.submit("r1", [1, 2, 3], SamplingParams(max_tokens=4), None)
        (who, job), = fake.jobs
        assert who == "any" and job.kv_sources == []

    _run(nats_url, body)


def test_a_lost_batch_is_asked_for_again_and_a_repeat_is_dropped(nats_url):
    """Rows carry their place in the stream: a gap makes the gateway ask the request's
    workers to send again from what it lacks, rows after the gap wait for that, and what
    it already has is not taken twice."""
    from moemesh.shared.protocol.messages import TokenResend

    async def body(mesh, fake):
        asked: list[tuple[str, TokenResend]] = []

        async def on_resend(msg):
            asked.append((msg.subject, decode(msg.data, TokenResend)))

        await fake.nc.subscribe(S.token_resend("*"), cb=on_resend)
        await fake.ack_jobs_on(S.prefill_direct("p1"), "p1")
        await fake.beat("d1", "decode")
        await fake.beat("p1", "prefill")
        await _until(lambda: mesh.live("decode") and mesh.live("prefill"))
        h = await mesh.submit("r1", [1, 2, 3], SamplingParams(max_tokens=6), None)

        async def send(ids, pos, end=None):
            ends = [TokenEnd(0, end)] if end else []
            await fake.nc.publish(S.gateway_tokens("gw-test", "d1"),
                                  encode(TokenBatch(["r1"], ids, [len(ids)], ends, "d1", positions=[pos])))

        await send([7], 0)  # the first token, from prefill
        await send([9], 2)  # position 1 was lost
        await send([10, 11], 3, "length")  # the end after a gap is not taken either
        await _until(lambda: len({s for s, _ in asked}) >= 2)  # both workers asked, however slow the loop
        await asyncio.sleep(0.1)  # and nobody else
        assert {s for s, _ in asked} == {S.token_resend("p1"), S.token_resend("d1")}
        assert all(r.request_ids == ["r1"] and r.from_positions == [1] for _, r in asked)
        assert h.ids == [7] and h.finish is None
        await send([8, 9, 10, 11], 1, "length")  # the resend: everything from 1 on, with the end
        await send([9], 2)  # a late repeat
        await _until(lambda: h.finish is not None)
        assert h.take() == ([7, 8, 9, 10, 11], [], "length", None)
        h.close()

    _run(nats_url, body)


LEAK = "KV transfer failed: no reply on mm.prefill.p1.kv.pull from decode-d1"


def test_a_refused_job_tells_the_client_no_worker_ids_or_subjects(nats_url, caplog):
    async def body(mesh, fake):
        async def refuse(msg):
            await msg.respond(encode(ErrorReply(f"duplicate request on mm.decode.d1.kv_ready: {LEAK}", "bad_request")))

        await fake.nc.subscribe(S.prefill_direct("p1"), cb=refuse)
        await fake.nc.flush()
        await fake.beat("d1", "decode")
        await fake.beat("p1", "prefill")
        await _until(lambda: mesh.live("decode") and mesh.live("prefill"))
        with pytest.raises(Rejected) as e:
            await mesh.submit("r1", [1, 2], SamplingParams(max_tokens=4), None)
        assert "mm." not in str(e.value) and "p1" not in str(e.value) and "d1" not in str(e.value)

    with caplog.at_level("WARNING"):
        _run(nats_url, body)
    assert LEAK in caplog.text  # the operator still sees what happened


def test_a_failed_request_tells_the_client_no_worker_ids_or_subjects(nats_url, caplog):
    async def body(mesh, fake):
        await fake.ack_jobs_on(S.prefill_direct("p1"), "p1")
        await fake.beat("d1", "decode")
        await fake.beat("p1", "prefill")
        await _until(lambda: mesh.live("decode") and mesh.live("prefill"))
        h = await mesh.submit("r1", [1, 2], SamplingParams(max_tokens=4), None)
        await fake.nc.publish(S.gateway_tokens("gw-test", "d1"),
                              encode(TokenBatch(["r1"], [], [0], [TokenEnd(0, "error", LEAK)], worker_id="d1")))
        await _until(lambda: h.finish is not None)
        assert h.take() == ([], [], "error", CLIENT_ERROR)
        h.close()

    with caplog.at_level("WARNING"):
        _run(nats_url, body)
    assert LEAK in caplog.text


def _count(counter) -> float:
    return next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))


def test_rows_from_a_worker_that_does_not_serve_the_request_are_dropped_counted_and_logged_once(nats_url, caplog):
    """A worker may publish only as itself, but it can name any request: only the prefill
    and decode workers serving a request get rows into its stream."""
    async def body(mesh, fake):
        await fake.ack_jobs_on(S.prefill_direct("p1"), "p1")
        await fake.beat("d1", "decode")
        await fake.beat("p1", "prefill")
        await _until(lambda: mesh.live("decode") and mesh.live("prefill"))
        h = await mesh.submit("r1", [1, 2, 3], SamplingParams(max_tokens=3), None)

        async def send(worker, ids, pos, end=None):
            ends = [TokenEnd(0, end)] if end else []
            await fake.nc.publish(S.gateway_tokens("gw-test", worker),
                                  encode(TokenBatch(["r1"], ids, [len(ids)], ends, worker, positions=[pos])))

        await send("p1", [7], 0)
        await send("d2", [666], 1)  # serves another request, or none
        await send("d2", [666, 667], 1, "length")  # its end is not taken either
        await send("d1", [8, 9], 1, "length")
        await _until(lambda: h.finish is not None)
        assert h.take() == ([7, 8, 9], [], "length", None)
        assert _count(mesh.c_refused) == 2
        h.close()

    with caplog.at_level("WARNING"):
        _run(nats_url, body)
    assert len([r for r in caplog.records if "dropped" in r.getMessage() and "d2" in r.getMessage()]) == 1


def test_a_hand_off_notice_from_the_prefill_worker_moves_the_stream_to_the_named_decode_worker(nats_url):
    """The decode worker chosen here did not answer the prefill worker, which handed the
    KV to another: its notice (on its own token subject) makes the gateway take that
    worker's rows, and no new request goes to the one that did not answer."""
    async def body(mesh, fake):
        await fake.ack_jobs_on(S.prefill_direct("p1"), "p1")
        for w in ("d1", "d2"):
            await fake.beat(w, "decode")
        await fake.beat("p1", "prefill")
        await _until(lambda: len(mesh.live("decode")) == 2 and mesh.live("prefill"))
        h = await mesh.submit("r1", [1, 2, 3], SamplingParams(max_tokens=3), None)
        assert h.decode_id == "d1"

        async def send(worker, ids, pos, end=None, handoffs=None):
            ends = [TokenEnd(0, end)] if end else []
            await fake.nc.publish(S.gateway_tokens("gw-test", worker), encode(TokenBatch(
                ["r1"], ids, [len(ids)], ends, worker, positions=[pos], handoffs=handoffs or {})))

        # Only the request's prefill worker may say so.
        await fake.nc.publish(S.gateway_tokens("gw-test", "d2"),
                              encode(TokenBatch([], [], [], [], "d2", handoffs={"r1": "d2"})))
        await asyncio.sleep(0.05)
        assert h.decode_id == "d1" and [hb.worker_id for hb in mesh.live("decode")] == ["d1", "d2"]
        await send("p1", [7], 0, handoffs={"r1": "d2"})
        await _until(lambda: h.decode_id == "d2")
        assert [hb.worker_id for hb in mesh.live("decode")] == ["d2"]  # d1 is suspect: no new requests
        await send("d1", [666], 1)
        await send("d2", [8, 9], 1, "length")
        await _until(lambda: h.finish is not None)
        assert h.take() == ([7, 8, 9], [], "length", None)
        assert _count(mesh.c_refused) == 2  # d2's notice, and d1's row
        h.close()

    _run(nats_url, body)


def test_a_worker_that_does_not_answer_gets_no_new_requests_until_it_beats_again(nats_url):
    """No responders on a prefill worker's own subject: the job goes to the queue group,
    and the worker is left out of routing at once, not only after its heartbeats lapse."""
    async def body(mesh, fake):
        await fake.ack_jobs_on(S.prefill_jobs, "any", queue=S.prefill_queue_group)
        await fake.ack_jobs_on(S.prefill_direct("p1"), "p1")
        await fake.beat("d1", "decode")
        await fake.beat("p1", "prefill")
        await fake.beat("pz", "prefill")  # beats, but nothing serves its subject; wins ties on its name
        await _until(lambda: len(mesh.live("prefill")) == 2 and mesh.live("decode"))
        await mesh.submit("r1", [1, 2, 3], SamplingParams(max_tokens=4), None)
        assert [who for who, _ in fake.jobs] == ["any"]
        assert [hb.worker_id for hb in mesh.live("prefill")] == ["p1"]
        await asyncio.sleep(0.6)  # half a heartbeat interval on: a beat now was sent after it was found gone
        await fake.beat("pz", "prefill")
        await _until(lambda: len(mesh.live("prefill")) == 2)

    _run(nats_url, body)
