import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_in_process import moemesh
from tests.profile.test_overhead import decode_result
from tests.profile.traces import BASE_NS, Trace, full_request, step

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def profile(*args) -> subprocess.CompletedProcess:
    return moemesh("profile", *args, cwd=ROOT)


def synthetic(tr: Trace) -> Trace:
    full_request(tr, "a", 0.0, queue=5, steps=[step(25.0, 2, 3.0, 1.0), step(30.0, 2, 3.0, 2.0)])
    full_request(tr, "b", 0.2, queue=15, steps=[step(25.001, 2, 3.0, 1.0), step(30.002, 2, 3.0, 2.0)])
    full_request(tr, "c", 500.0, skip=("decode", "kv.transfer"))  # failed before decode
    return tr


def test_trace_end_to_end_writes_json_and_png(tmp_path):
    trace = synthetic(Trace()).write(tmp_path / "trace.jsonl")
    with trace.open("a") as f:
        f.write('{"name": "cut off by a cr\n')
    out = tmp_path / "out" / "profile.json"
    r = profile(trace, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "per request: 2 complete of 3; incomplete: no decode span: 1" in r.stdout
    assert "per decode step: 2 steps from 4 step events (workers: decode-a)" in r.stdout
    assert "skipped 1 malformed line" in r.stderr
    doc = json.loads(out.read_text())
    q = doc["requests"]["phases"]["queue"]
    assert (q["n"], q["p50"], q["mean"]) == (2, 10.0, 10.0)
    assert doc["requests"]["phases"]["decode"]["p50"] == 72.0
    assert doc["steps"]["num_steps"] == 2 and doc["steps"]["phases"]["host"]["mean"] == 1.5
    assert [p["complete"] for p in doc["per_request"]] == [True, True, False]
    assert doc["per_request"][0]["phases_ms"]["kv_transfer"] == 4.0
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)


def test_overhead_end_to_end(tmp_path):
    dec = tmp_path / "decode.json"
    dec.write_text(json.dumps(decode_result()))
    fwd = tmp_path / "forward.json"
    fwd.write_text(json.dumps({"bench": "forward", "decode": [{"batch": 8, "context_len": 544,
                                                                "forward_tokens_per_s": 1600.0}]}))
    png = tmp_path / "chart.png"
    r = profile("--overhead", dec, "--out", tmp_path / "o.json", "--png", png)
    assert r.returncode == 0, r.stderr
    assert "headline: serving overhead 21.7% (mean over batch 8..64; 20.0% at 8, 25.0% at 32)" in r.stdout
    assert "made of: host 8.0 pts (loop gap 1.0), rank wait 1.0, forward drift 2.5, rest 8.5" in r.stdout
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert json.loads((tmp_path / "o.json").read_text())["overhead"]["runs"][0]["headline"]["batches"] == [8, 32, 64]
    r = profile("--overhead", dec, "--forward", fwd, "--out", "")
    assert r.returncode == 0, r.stderr
    assert "headline: serving overhead 50.0%" in r.stdout and "batch 64 left out" in r.stdout


def test_trace_and_overhead_together(tmp_path):
    trace = synthetic(Trace()).write(tmp_path / "trace.jsonl")
    dec = tmp_path / "decode.json"
    dec.write_text(json.dumps(decode_result()))
    r = profile(trace, "--overhead", dec, "--out", tmp_path / "p.json")
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    assert {"requests", "steps", "overhead"} <= doc.keys()
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)


def test_bad_input_exits_2_and_empty_trace_exits_1(tmp_path, capsys):
    from moemesh.tools.cli.main import main

    def run(*args) -> int:
        return main(["profile", *map(str, args)])

    assert run("--out", "") == 2
    assert run(tmp_path / "missing.jsonl", "--out", "") == 2
    (tmp_path / "bad.json").write_text('{"bench": "serve"}')
    assert run("--overhead", tmp_path / "bad.json", "--out", "") == 2
    assert "bench decode" in capsys.readouterr().err
    assert run("--live", "--seconds", "1", "--out", "") == 2
    assert run(tmp_path / "decode.json", "--forward", tmp_path / "f.json", "--out", "") == 2
    (tmp_path / "empty.jsonl").write_text("")
    assert run(tmp_path / "empty.jsonl", "--out", tmp_path / "e.json") == 1
    assert (tmp_path / "e.json").exists() and not (tmp_path / "e.png").exists()


def _shift(tr: Trace, delta_ns: int) -> None:
    for s in tr.records:
        s["start_time_ns"] += delta_ns
        s["end_time_ns"] += delta_ns
        for e in s["events"]:
            e["time_ns"] += delta_ns


async def _heartbeat(url: str, proc) -> None:
    """Beats as decode-a until the watcher exits (its window may close before a first beat
    lands on a busy machine)."""
    import nats

    from moemesh.shared.protocol.messages import Heartbeat, WorkerLoad, encode
    from moemesh.shared.protocol.subjects import Subjects

    nc = await nats.connect(url)
    try:
        for _ in range(300):
            await nc.publish(Subjects().heartbeat("decode", "decode-a"),
                             encode(Heartbeat("decode-a", "decode", "tiny", WorkerLoad())))
            await nc.flush()
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


def test_live_window(tmp_path):
    from moemesh.tools.launch.nats_server import NatsServerNotFound, start_nats
    from moemesh.tools.launch.procs import ProcessGroup, free_port

    trace = tmp_path / "trace.jsonl"
    old = Trace()
    full_request(old, "old", 0.0)  # long before the window: must be left out
    old.write(trace)
    group = ProcessGroup(tmp_path / "logs")
    port = free_port()
    try:
        try:
            start_nats(group, port)
        except NatsServerNotFound:
            pytest.skip("no nats-server binary")
        url = f"nats://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "moemesh.tools.cli.main", "profile", "--live", "--nats-url", url,
                                 "--trace-file", str(trace), "--seconds", "2", "--grace", "0.3",
                                 "--out", str(tmp_path / "live.json")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stderr.readline()
            assert "watching" in line, line + proc.stderr.read()
            new = Trace()
            full_request(new, "new", 0.0, steps=[step(25.0, 1, 3.0, 1.0)])
            _shift(new, time.time_ns() + 10_000_000 - BASE_NS)
            with trace.open("a") as f:
                f.writelines(json.dumps(s) + "\n" for s in new.records)
            asyncio.run(_heartbeat(url, proc))
            stdout, stderr = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, stderr
        assert "workers seen: decode-a (decode)" in stdout
        doc = json.loads((tmp_path / "live.json").read_text())
        assert doc["requests"]["num_requests"] == 1 and doc["requests"]["num_complete"] == 1
        assert doc["per_request"][0]["request_id"] == "r-new"
        assert doc["steps"]["num_steps"] == 1
    finally:
        group.stop()


def test_every_phase_is_readable_on_the_chart():
    # decode runs for seconds, a KV transfer for a millisecond: each gets its own bar on a log axis
    from moemesh.tools.profile import report

    plt = report._plt()
    fig, ax = plt.subplots()
    report._bars(ax, {"queue": 0.4, "prefill": 12.0, "kv_transfer": 0.9, "decode": 4000.0, "streaming": 0.0},
                 "t", "ms")
    assert ax.get_xscale() == "log" and len(ax.patches) == 4
    top_down = sorted(((y, t.get_text()) for y, t in zip(ax.get_yticks(), ax.get_yticklabels())), reverse=True)
    assert [t for _, t in top_down] == ["queue", "prefill", "KV transfer", "decode"]
    widths = sorted(p.get_width() for p in ax.patches)
    assert widths == [0.4, 0.9, 12.0, 4000.0]
    plt.close(fig)
