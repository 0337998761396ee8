"""`python -m moemesh.tools.bench.mesh_gpu`: the mesh with its workers on a device, one
streamed chat completion through it, and the prefill-to-decode hand-off that made it.

1. up: the launcher's Mesh (what `moemesh up` runs: a gateway, a prefill and a decode
   worker, on a NATS server started here) with `--set device=DEVICE` for the workers, and
   UCX asked to print the protocols it picks into their logs (UCX_PROTO_INFO=y);
2. stream: one chat completion with stream=True, through the openai client (plain HTTP
   server-sent events when it is not installed), ignore_eos so that decode steps run;
3. hand-off: the request's `kv.send` (prefill) and `kv.transfer` (decode) spans in the
   trace file: the bytes moved, and no error;
4. where the KV was: each worker's device memory as nvidia-smi lists it (on a GPU), and
   from the worker logs the memory UCX sent from and the transports it used.

It writes JSON (--out) with a verdict and a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port
from moemesh.tools.launch.up import Mesh, UpConfig

_PROTO_HEAD = re.compile(r"\|\s*ucp_context_\d+\s+(?P<scope>[\w-]+).*?\|\s*(?P<op>.+?) from (?P<mem>[\w-]+) memory")
_PROTO_ROW = re.compile(r"\|\s*[\d.KMGinf]+\s*\|\s*(?P<proto>[^|]+?)\s*\|\s*(?P<tl>[^|]+?)\s*\|\s*$")


def ucx_protocols(log_text: str) -> list[dict]:
    """UCX_PROTO_INFO's tables in a log: for each operation UCX selected protocols for, the
    memory it sends from and the transports (e.g. sysv/memory, cuda_copy/cuda, tcp/lo)."""
    out: list[dict] = []
    for line in log_text.splitlines():
        head = _PROTO_HEAD.search(line)
        if head:
            out.append({"scope": head["scope"], "op": head["op"].strip(), "memory": head["mem"], "transports": []})
            continue
        row = _PROTO_ROW.search(line)
        if row and out:
            for tl in (t.strip() for t in row["tl"].split(",")):
                if tl and tl not in out[-1]["transports"]:
                    out[-1]["transports"].append(tl)
    return out


def stream_chat(url: str, model: str, max_tokens: int, trace_id: str) -> dict:
    """One streamed chat completion, in the client's trace trace_id (so that its spans are
    found): its text, chunks, finish reason and timings."""
    t0 = time.perf_counter()
    headers = {"traceparent": f"00-{trace_id}-{'1' * 16}-01"}
    body = {"model": model, "messages": [{"role": "user", "content": "Hello from the GPU check"}],
            "max_tokens": max_tokens, "stream": True}
    first = None
    pieces: list[str] = []
    finish = None
    for delta, reason in _chunks(url, body, headers):
        if first is None:
            first = time.perf_counter() - t0
        pieces += [delta] if delta else []
        finish = reason or finish
    return {"client": _client_name(), "text": "".join(pieces), "content_chunks": len(pieces), "finish_reason": finish,
            "ttft_s": first, "seconds": time.perf_counter() - t0}


def _client_name() -> str:
    try:
        import openai
    except ImportError:
        return "httpx (server-sent events)"
    return f"openai {openai.__version__}"


def _chunks(url: str, body: dict, headers: dict):
    """(content delta, finish reason) per streamed chunk."""
    try:
        from openai import OpenAI
    except ImportError:
        yield from _sse_chunks(url, body, headers)
        return
    client = OpenAI(base_url=url + "/v1", api_key="gpu-check", max_retries=0, timeout=60)
    extra = {"ignore_eos": True}
    stream = client.chat.completions.create(extra_headers=headers, extra_body=extra, **body)
    for chunk in stream:
        for c in chunk.choices:
            yield c.delta.content, c.finish_reason


def _sse_chunks(url: str, body: dict, headers: dict):
    import httpx

    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"ignore_eos": True}, headers=headers,
                      timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                yield c.get("delta", {}).get("content"), c.get("finish_reason")


def handoff_spans(trace_file: Path, trace_id: str) -> dict:
    """The client's request's KV hand-off, from the trace file's spans."""
    spans = [json.loads(line) for line in trace_file.read_text().splitlines() if line.strip()] \
        if trace_file.exists() else []
    mine = [s for s in spans if s.get("trace_id") == trace_id]
    out = {}
    for name in ("kv.send", "kv.transfer"):
        hits = [s for s in mine if s["name"] == name]
        out[name] = [{"bytes": s["attributes"].get("kv.bytes"), "status": s["status"]["code"],
                      "service": s["resource"]["service.name"], "seconds": s["attributes"].get("kv.seconds")}
                     for s in hits]
    return out


def wait_for_handoff(trace_file: Path, trace_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        h = handoff_spans(trace_file, trace_id)
        if all(h.values()) or time.monotonic() > deadline:
            return h
        time.sleep(0.2)


def gpu_processes(pids: dict[str, int]) -> dict:
    """nvidia-smi's compute processes, and which of them are the mesh's workers."""
    try:
        res = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    rows = [[c.strip() for c in line.split(",")] for line in res.stdout.splitlines() if line.strip()]
    used = {int(r[0]): r[1] for r in rows if r and r[0].isdigit()}
    return {"all": used, "workers": {name: used.get(pid) for name, pid in pids.items()}}


def run(model: str, device: str, log_dir: Path, max_tokens: int, ready_timeout_s: float) -> dict:
    """The mesh's NATS server is started here on a free port and given to it, as
    `moemesh up --nats-url` takes one: left to itself `up` takes port 4222 when it looks
    free, which another mesh starting at the same moment may take too."""
    nats = ProcessGroup(log_dir)
    try:
        port = free_port()
        start_nats(nats, port)
        return _serve(model, device, log_dir, f"nats://127.0.0.1:{port}", max_tokens, ready_timeout_s)
    finally:
        nats.stop()


def _serve(model: str, device: str, log_dir: Path, nats_url: str, max_tokens: int, ready_timeout_s: float) -> dict:
    trace = log_dir / "trace.jsonl"
    cfg = UpConfig(model=model, nats_url=nats_url, port=0, log_dir=str(log_dir), trace_file=str(trace),
                   ready_timeout_s=ready_timeout_s, extra_env={"UCX_PROTO_INFO": "y"},
                   service_args=(f"device={device}", "num_kv_blocks=256", "staging_mb=64"))
    result: dict = {"device": device, "model": model, "log_dir": str(log_dir)}
    t0 = time.monotonic()
    with Mesh(cfg) as mesh:
        result["up_s"] = round(time.monotonic() - t0, 1)
        trace_id = secrets.token_hex(16)
        result["stream"] = stream_chat(mesh.url, Path(model).name, max_tokens, trace_id)
        result["handoff"] = wait_for_handoff(trace, trace_id, 10.0)
        if device.startswith("cuda"):
            workers = {c.name: c.popen.pid for c in mesh.group.children if c.name.startswith(("prefill", "decode"))}
            result["gpu_memory"] = gpu_processes(workers)
    result["ucx"] = {p.stem: ucx_protocols(p.read_text(errors="replace"))
                     for p in sorted(log_dir.glob("*.log")) if p.stem.startswith(("prefill", "decode"))}
    return result


def verdict(result: dict) -> tuple[str, str, str]:
    """(verdict, reason, one-line summary)."""
    if "error" in result:
        return "fail", result["error"], "the mesh did not come up"
    s, h = result["stream"], result["handoff"]
    moved = [x for name in ("kv.send", "kv.transfer") for x in h[name]]
    reasons = []
    if s["finish_reason"] != "length":
        reasons.append(f"the stream ended with finish_reason={s['finish_reason']!r}, not after its max_tokens")
    if not h["kv.send"] or not h["kv.transfer"]:
        reasons.append("no KV hand-off in the trace (kv.send and kv.transfer spans)")
    if any(x["status"] == "ERROR" or not x["bytes"] for x in moved):
        reasons.append("a KV hand-off span has an error or moved no bytes")
    ops = [op for ops in result["ucx"].values() for op in ops]
    mems = sorted({op["memory"] for op in ops})
    tls = sorted({tl for op in ops for tl in op["transports"]})
    ucx = f"UCX from {'/'.join(mems)} memory over {', '.join(tls)}" if ops else "UCX reported no protocols"
    nbytes = h["kv.transfer"][0]["bytes"] if h["kv.transfer"] else 0
    summary = (f"{result['device']}: up in {result['up_s']:.0f} s; {s['content_chunks']} chunks streamed "
               f"({s['client']}), TTFT {s['ttft_s'] or 0:.2f} s; KV hand-off {nbytes} B; {ucx}")
    return ("fail" if reasons else "pass"), "; ".join(reasons), summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mesh_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (the tiny model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--log-dir", default="mesh-logs", help="the services' logs and the trace file (a new folder:"
                    " logs are appended to, and UCX's tables are read from all of them)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--ready-timeout", type=float, default=90.0)
    ap.add_argument("--out", default="mesh.json")
    a = ap.parse_args(argv)
    log_dir = Path(a.log_dir).resolve()
    try:
        result = run(a.model, a.device, log_dir, a.max_tokens, a.ready_timeout)
    except (RuntimeError, TimeoutError, OSError) as e:
        result = {"device": a.device, "model": a.model, "log_dir": str(log_dir), "error": f"{type(e).__name__}: {e}"}
    result["verdict"], result["reason"], result["summary"] = verdict(result)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(result["summary"] + (f"\nFAIL: {result['reason']}" if result["reason"] else ""))
    return 0 if result["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
