"""`moemesh up` as a user runs it."""

from __future__ import annotations

import json
import os
import re
import signal
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


def _stat(pid: int) -> tuple[str, list[str]] | None:
    """(command name, the fields after it) of a live process, None for a gone or zombie one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    return None if rest[0] == "Z" else (stat[stat.index("(") + 1:stat.rindex(")")], rest)


def _children_named(parent: int, prefix: str) -> list[tuple[int, str]]:
    """(pid, start time) of `parent`'s live children whose name starts with `prefix`: the
    start time tells a process apart from a later one given the same pid."""
    out = []
    for d in Path("/proc").iterdir():
        st = _stat(int(d.name)) if d.name.isdigit() else None
        if st and st[0].startswith(prefix) and int(st[1][1]) == parent:
            out.append((int(d.name), st[1][19]))
    return out


def _started_at(pid: int) -> str | None:
    st = _stat(pid)
    return st[1][19] if st else None


def _up(tmp_path, *args) -> subprocess.Popen:
    env = dict(os.environ, MOEMESH_HOME=str(tmp_path / "home"))
    argv = [sys.executable, "-m", "moemesh.tools.cli.main", "up", "--port", "0", "--log-dir", str(tmp_path / "logs")]
    return subprocess.Popen([*argv, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_up(p: subprocess.Popen) -> tuple[str, int, list[str]]:
    """(gateway URL, NATS port, what `moemesh up` printed up to "Ctrl-C")."""
    url = nats_port = None
    lines = []
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
    return url, nats_port, lines


def _stop(p: subprocess.Popen) -> int:
    p.send_signal(signal.SIGINT)
    rc = p.wait(60)
    p.stdout.close()
    return rc


def test_up_starts_answers_a_stream_and_stops_cleanly(tmp_path):
    """With two gateways (`--gateways 2`, on consecutive ports): each streams a completion
    from the same workers."""
    p = _up(tmp_path, "--gateways", "2")
    nats = []
    try:
        url, _, lines = _wait_up(p)
        urls = re.search(r"moemesh is up: ((?:http://\S+\s+)+)\(", "".join(lines)).group(1).split()
        port = int(url.rsplit(":", 1)[1])
        assert urls == [url, url.replace(f":{port}", f":{port + 1}")]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "stream": True, "max_tokens": 5}
        for u in urls:
            r = httpx.post(u + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert "curl" in "".join(lines)
        assert sorted(f.name for f in (tmp_path / "logs").glob("gateway*.log")) == ["gateway-0.log", "gateway-1.log"]
        assert _procs_mentioning(str(tmp_path / "home"))  # the workers run with the model made there
        # Known by process, not by port: once this one is gone, another test's `up` may take 4222.
        nats = _children_named(p.pid, "nats-server")
        assert len(nats) == 1, nats
    finally:
        rc = _stop(p)
    assert rc == 0
    time.sleep(0.5)
    assert _procs_mentioning(str(tmp_path / "home")) == []
    assert _procs_mentioning(str(tmp_path / "logs")) == []
    assert not [pid for pid, t in nats if _started_at(pid) == t], "the NATS server it started is still running"


def test_up_with_a_v4_model_folder_streams_a_completion(tmp_path, tiny_v4_model):
    """`moemesh up --model DIR` on a DeepSeek-V4 checkpoint: the prompt is prefilled on one
    worker, its hybrid cache handed to the other, and the completion streams back."""
    trace = tmp_path / "trace.jsonl"
    p = _up(tmp_path, "--model", tiny_v4_model, "--trace-file", str(trace))
    try:
        url, _, lines = _wait_up(p)
        printed = "".join(lines)
        name = os.path.basename(tiny_v4_model)
        assert f"model {tiny_v4_model}" in printed and f'"model": "{name}"' in printed
        assert len(_procs_mentioning(tiny_v4_model)) >= 3  # prefill, decode and the gateway
        body = {"model": name, "prompt": "The experts of the fourth model route every token", "stream": True,
                "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 12
        assert "".join(c["text"] for e in events for c in e["choices"])
    finally:
        rc = _stop(p)
    assert rc == 0
    assert _procs_mentioning(tiny_v4_model) == []
    # The tokens after the first came from the decode worker, after a KV hand-off.
    spans = [json.loads(x) for x in trace.read_text().splitlines() if x.strip()]
    pulls = [s for s in spans if s["name"] == "kv.transfer"]
    assert len(pulls) == 1 and pulls[0]["attributes"]["kv.bytes"] > 0 and pulls[0]["status"]["code"] != "ERROR"


def test_up_starts_a_dep_instance_again_when_one_of_its_ranks_dies(tmp_path):
    """A rank killed: its peer leaves (its instance cannot step), and `moemesh up` starts
    both ranks again, as a supervisor would; the mesh serves again without a restart."""
    p = _up(tmp_path, "--dep", "2", "--set", "engine=mock", "--set", "mock_step_ms=10")
    try:
        url, _, _ = _wait_up(p)
        (r1,) = _procs_mentioning("decode-i0-r1\x00")  # its --worker-id (cmdline args end in NUL)
        os.kill(r1, signal.SIGKILL)
        deadline = time.monotonic() + 60
        line = ""
        while "started again" not in line:
            assert time.monotonic() < deadline, "the instance was not started again"
            line = p.stdout.readline()
        assert "decode-i0-r0, decode-i0-r1 exited; started again" in line
        while httpx.get(url + "/health", timeout=5).json()["workers"]["decode"] < 2:
            assert time.monotonic() < deadline, "the restarted instance did not join"
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert p.poll() is None
    finally:
        rc = _stop(p)
    assert rc == 0
