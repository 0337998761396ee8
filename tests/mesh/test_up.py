"""`moemesh up` as a user runs it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _procs_mentioning(needle: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def test_up_starts_answers_a_stream_and_stops_cleanly(tmp_path):
    env = dict(os.environ, MOEMESH_HOME=str(tmp_path / "home"))
    p = subprocess.Popen([sys.executable, "-m", "moemesh.tools.cli.main", "up", "--port", "0", "--log-dir",
                          str(tmp_path / "logs")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = nats_port = None
    lines = []
    try:
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"moemesh is up: (http://\S+) .*NATS nats://127.0.0.1:(\d+)", line)
            if m:
                url, nats_port = m.group(1), int(m.group(2))
        assert url, "".join(lines)
        while "Ctrl-C" not in lines[-1]:
            lines.append(p.stdout.readline())
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "stream": True, "max_tokens": 5}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert "curl" in "".join(lines)
        assert _procs_mentioning(str(tmp_path / "home"))  # the workers run with the model made there
    finally:
        p.send_signal(signal.SIGINT)
        rc = p.wait(60)
        p.stdout.close()
    assert rc == 0
    time.sleep(0.5)
    assert _procs_mentioning(str(tmp_path / "home")) == []
    assert _procs_mentioning(str(tmp_path / "logs")) == []
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", nats_port)) != 0, "the NATS server it started is still running"
