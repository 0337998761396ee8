"""A DEP rank that stops answering: its peer's collective gives up after dp_timeout_s
(it never hangs), and the peer leaves the mesh at once. Its last beat says so, the
gateway takes it out of routing without waiting for missed beats, and the process exits
with an error, since an instance short of a rank cannot step. With no other decode
worker here, the stream in flight ends with a clear error instead of hanging."""

from __future__ import annotations

import signal
import time

import httpx

from tests.mesh.conftest import start_mesh

DP_TIMEOUT_S = 2.0


def test_a_stopped_rank_times_its_peer_out_and_the_peer_leaves(tiny_model, tmp_path):
    mock = ["engine=mock", "mock_step_ms=20"]
    m = start_mesh(tmp_path, tiny_model, decode_dp=2, prefill_set=mock,
                   decode_set=[*mock, f"dp_timeout_s={DP_TIMEOUT_S}"])
    try:
        ranks = {c.name: c for c in m.group.children if c.name.startswith("decode-r")}
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", m.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            ranks["decode-r1"].popen.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            rest = list(lines)  # the stream ends: it does not wait out the 60 s inactivity timeout
            took = time.monotonic() - t0
        assert took < DP_TIMEOUT_S + 8, took
        assert any('"error"' in line for line in rest), rest[-3:]
        assert ranks["decode-r0"].popen.wait(10) == 1  # it left, with an error
        log = (tmp_path / "logs" / "decode-r0.log").read_text()
        assert "leaving the mesh without a drain" in log
        gw = (tmp_path / "logs" / "gateway.log").read_text()
        assert "worker decode-t-r0 left" in gw
        health = httpx.get(m.url + "/health").json()
        assert health["workers"]["decode"] == 0
        assert health["instances_down"] == {"decode-t": "rank decode-t-r0 left"}
        assert "moemesh_dep_instances_down 1.0" in httpx.get(m.url + "/metrics").text.replace('{model_name="tiny"}', "")
    finally:
        for c in m.group.children:
            if c.alive():
                c.popen.send_signal(signal.SIGCONT)
        m.group.stop()
