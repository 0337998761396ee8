"""A send to a host whose network was cut fails by its timeout and never holds the event
loop. UCX's TCP transport connects a new endpoint with a blocking connect() unless told
otherwise (ucx_options sets TCP_CONN_NB): to an unreachable host that held the loop for
40-130 s, and a worker whose loop is held misses its heartbeats and is taken for dead.
Needs root: sender and receiver are in network namespaces of their own, and the test
takes the receiver's link down (tests/transport/ucx_peer.py is the two sides)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moemesh.tools.launch.rack_net import DATA_DEV, RackNetwork

pytestmark = pytest.mark.skipif(not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip")),
                                reason="network namespaces need root and iproute2")
ROOT = Path(__file__).resolve().parents[2]


def test_a_send_to_a_cut_host_never_holds_the_event_loop(tmp_path):
    with RackNetwork(2, tag="ut", subnet=233) as net:
        sender, receiver = net.hosts

        def side(role: str, host) -> subprocess.Popen:
            return subprocess.Popen([*host.prefix, sys.executable, "-m", "tests.transport.ucx_peer", role, DATA_DEV,
                                     str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE if role == "send" else subprocess.DEVNULL, text=True)

        procs = [side("recv", receiver), side("send", sender)]
        try:
            deadline = time.monotonic() + 60
            while not (tmp_path / "ready").exists():
                assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "a side did not start"
                time.sleep(0.05)
            net.set_plane(receiver.name, "data", up=False)
            (tmp_path / "cut").write_text("")
            out, _ = procs[1].communicate(timeout=60)
        finally:
            for p in procs:
                p.kill()
                p.wait(10)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["error"], r  # the send failed ...
    assert r["took_s"] < 5.0, r  # ... by its own 2 s timeout
    assert r["max_lag_s"] < 1.0, r  # and the loop ran on meanwhile
