"""The profile of a real mesh's trace: the span names and tree it assumes are the ones
the services write."""

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.mesh.conftest import start_mesh

ROOT = Path(__file__).resolve().parents[2]


def test_profile_of_a_real_mesh(tiny_model, tmp_path):
    # No MTP drafts: then every decode step gives one token, and the step count below is exact.
    mesh = start_mesh(tmp_path, tiny_model, decode_set=["num_speculative_tokens=0"])
    try:
        with httpx.Client(base_url=mesh.url, timeout=60) as client:
            for i in range(3):
                body = {"model": "tiny", "prompt": f"hello number {i}", "max_tokens": 6, "ignore_eos": True,
                        "stream": i != 2}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
        time.sleep(0.5)  # the gateway ends its span as the response finishes; let it land
    finally:
        mesh.group.stop()
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "moemesh.tools.cli.main", "profile", str(mesh.trace_file), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    req = doc["requests"]
    assert req["num_requests"] == 3 and req["num_complete"] == 3, req
    for name in ("queue", "prefill", "kv_transfer", "decode", "streaming"):
        ph = req["phases"][name]
        assert ph["n"] == 3 and ph["p50"] >= 0, (name, ph)
    assert req["ttft_ms"]["n"] == 2  # the non-streamed request has no stream span
    assert sum(req["phases"][k]["share"] for k in req["phases"]) > 0.999
    steps = doc["steps"]
    # one request at a time, each decoding 5 tokens after the prefill's first
    assert 3 * 5 <= steps["num_steps"] <= steps["num_events"], steps
    assert steps["phases"]["forward"]["mean"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
