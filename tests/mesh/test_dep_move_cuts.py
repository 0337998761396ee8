"""A live expert move cut halfway, on a DEP2 instance of the real tiny model: the weights
are staged on both ranks and the commit has not gone out (the balancer holds it back,
debug_commit_delay_s), when
1. the balancer is killed: no rank ever switches, both drop their staging once the move
   times out, and output at temperature 0 is what it was;
2. a rank is killed (a second move, under a new balancer): its peer leaves the mesh
   without switching, and the gateway takes the instance out of routing.
No rank ever runs on a mixed placement: a move commits on every rank or on none."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import nats

from moemesh.shared.protocol.messages import MoveStaged, SamplingParams, decode
from moemesh.shared.protocol.subjects import Subjects
from moemesh.shared.service.nats_io import NoResponders
from tests.mesh.test_dep_mesh import PROMPTS, _mesh, _placement_version, _rebalance, _stream_all, _swap_halves

MOVE_TIMEOUT_S = 4.0


def _cut_once_staged(mesh, kill) -> threading.Thread:
    """Start a move; once both ranks have staged it, call kill(). Returns the thread that asked
    for the move, for the test to join: its request ends by its own timeout when the balancer
    that took it is gone, and a thread left asking would outlive the mesh and the test."""
    subscribed = threading.Event()

    async def watch():
        nc = await nats.connect(mesh.nats_url)
        try:
            sub = await nc.subscribe(Subjects().eplb(mesh.decode_id, "staged"))
            await nc.flush()  # the server has the subscription
            subscribed.set()
            ranks = set()
            while len(ranks) < 2:
                m = decode((await sub.next_msg(timeout=30)).data, MoveStaged)
                assert m.ok, m.error
                ranks.add(m.rank)
        finally:
            await nc.close()

    reply: list = []

    def move():
        deadline = time.monotonic() + 30
        while True:  # a balancer just started may not have subscribed yet
            r = _safe(lambda: _rebalance(mesh, _swap_halves(), timeout_s=MOVE_TIMEOUT_S + 4))
            if not isinstance(r, NoResponders) or time.monotonic() > deadline:
                return reply.append(r)
            time.sleep(0.2)

    mover = threading.Thread(target=move, daemon=True)
    done = threading.Event()

    def run():
        asyncio.run(watch())
        done.set()

    watcher = threading.Thread(target=run, daemon=True)
    watcher.start()
    assert subscribed.wait(30), "the watcher never subscribed"  # before the plan goes out
    mover.start()
    assert done.wait(40), f"the ranks never staged the move: {reply}"
    kill()
    return mover


def _safe(f):
    try:
        return f()
    except Exception as e:  # the balancer it asked was killed: no reply
        return e


def _log(mesh, name: str) -> str:
    return (mesh.trace_file.parent / "logs" / f"{name}.log").read_text(errors="replace")


def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _child(mesh, name: str):
    return mesh.group.live(name)


def test_a_move_cut_before_its_commit_switches_no_rank(tiny_model, tmp_path_factory, offline):
    cut = ["debug_commit_delay_s=60", f"move_timeout_s={MOVE_TIMEOUT_S}"]
    mesh = _mesh(tmp_path_factory.mktemp("depcut"), tiny_model, balancer_set=cut)
    try:
        want = [o.text for o in offline.generate(PROMPTS[:4], SamplingParams(max_tokens=8, temperature=0,
                                                                             ignore_eos=True))]
        # 1. The balancer dies between staged and commit.
        mover = _cut_once_staged(mesh, lambda: _child(mesh, "balancer").popen.send_signal(signal.SIGKILL))
        for r in (0, 1):
            _until(lambda: "was never committed; dropping it" in _log(mesh, f"decode-r{r}"), MOVE_TIMEOUT_S + 10,
                   f"rank {r} kept the staged move")
        assert _placement_version(mesh) == 0
        got, _ = _stream_all(mesh, PROMPTS[:4], 8)
        assert got == want
        mover.join(MOVE_TIMEOUT_S + 10)
        assert not mover.is_alive()

        # 2. A new balancer; a second move; a rank dies between staged and commit.
        argv = next(c for c in mesh.group.children if c.name == "balancer").popen.args
        mesh.group.start("balancer", list(argv))
        mover = _cut_once_staged(mesh, lambda: _child(mesh, "decode-r1").popen.send_signal(signal.SIGKILL))
        r0 = next(c for c in mesh.group.children if c.name == "decode-r0")
        assert r0.popen.wait(30) == 1  # it left: its instance is short of a rank
        for r in (0, 1):
            assert "switched to expert placement" not in _log(mesh, f"decode-r{r}")
        _until(lambda: httpx.get(mesh.url + "/health").json()["workers"]["decode"] == 0, 10,
               "the broken instance is still routed to")
        mover.join(MOVE_TIMEOUT_S + 10)
        assert not mover.is_alive()
    finally:
        mesh.group.stop()
