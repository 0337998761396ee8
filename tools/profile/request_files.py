"""The project files one streamed chat request passes, found by running it.

docs/architecture.md counts the files a `POST /v1/chat/completions` (stream, n = 1)
calls functions in, from the gateway's first header byte to `data: [DONE]`. This runs
that request through a mesh in this process (a real nats-server, prefill, decode and a
gateway, the KV over UCX) with a trace hook on every thread, and lists the files in the
order the request first reaches them, by the same rules:

- only `services/` and `shared/` count, and no `__init__.py`;
- nothing below the engine's facade: a call counts only if no project frame under it is
  in `shared/engine/` or `shared/model/` (so `engine.py` and the engine files the
  services call directly count, and nothing they call does);
- code that runs whether or not a request is there does not count: each call is an edge
  (calling function, called function), and every edge seen in the idle windows of the
  mesh before and after the request is dropped from the request's window. Each window
  holds several heartbeats, so that a periodic check (a worker's beat, the gateway's
  sweep for silent workers) is seen idle whatever the machine's load.

    moemesh profile --request-files [--out bench-results/request-files.json]
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType

PROJECT = Path(__file__).resolve().parents[2]
COUNTED = ("services/", "shared/")
BELOW_FACADE = ("shared/engine/", "shared/model/")

# A function by where it is: code objects compare by content, so two alike functions in
# two files would be one.
Func = tuple[str, int, str]  # (filename, first line, qualified name)
Edge = tuple[Func | None, Func]


def func(code: CodeType) -> Func:
    return code.co_filename, code.co_firstlineno, code.co_qualname


def project_path(filename: str) -> str | None:
    """The file's path under the project when it is one of the counted folders."""
    try:
        rel = Path(filename).resolve().relative_to(PROJECT).as_posix()
    except ValueError:
        return None
    return rel if rel.startswith(COUNTED) else None


@dataclass
class EdgeRecorder:
    """Calls between project functions, recorded from every thread while on."""

    on: bool = False
    edges: dict[Edge, int] = field(default_factory=dict)  # edge -> order first seen
    _paths: dict[str, str | None] = field(default_factory=dict)

    def path(self, filename: str) -> str | None:
        p = self._paths.get(filename, ...)
        if p is ...:
            p = self._paths[filename] = project_path(filename)
        return p

    def trace(self, frame: FrameType, event: str, arg) -> None:
        # A global trace function sees only calls; returning None keeps line events off.
        if not self.on or self.path(frame.f_code.co_filename) is None:
            return None
        caller, f = None, frame.f_back
        while f is not None:  # through library frames (asyncio, nats, torch) to ours
            p = self.path(f.f_code.co_filename)
            if p is not None:
                if p.startswith(BELOW_FACADE):
                    return None  # the engine's facade or what it calls made this call
                caller = caller or func(f.f_code)
            f = f.f_back
        self.edges.setdefault((caller, func(frame.f_code)), len(self.edges))
        return None

    def install(self) -> None:
        threading.settrace(self.trace)
        sys.settrace(self.trace)

    def remove(self) -> None:
        threading.settrace(None)  # type: ignore[arg-type]
        sys.settrace(None)

    def take(self) -> dict[Edge, int]:
        edges, self.edges = self.edges, {}
        return edges


def request_files(request: dict[Edge, int], idle: dict[Edge, int]) -> list[str]:
    """The files the request's own calls reach, in the order first reached (pure)."""
    seen: dict[str, int] = {}
    for (caller, callee), order in request.items():
        if (caller, callee) in idle:
            continue
        dst = project_path(callee[0])
        if dst is None or dst.endswith("__init__.py"):
            continue
        seen.setdefault(dst, order)
    return sorted(seen, key=seen.get)


async def _chat(url: str, max_tokens: int) -> str:
    import httpx

    body = {"model": "tiny", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello to the mesh."}]}
    async with httpx.AsyncClient(timeout=60) as c:
        async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            text = "".join([line async for line in r.aiter_lines()])
    if r.status_code != 200 or "data: [DONE]" not in text:
        raise RuntimeError(f"the request failed: {r.status_code} {text[:300]}")
    return text


async def _ready(url: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        while True:
            h = (await c.get(url + "/health/ready")).json()
            if h["ready"] and h["workers"]["decode"] >= 1 and h["workers"]["prefill"] >= 1:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the mesh was not ready in {timeout:g} s: {h}")
            await asyncio.sleep(0.05)


async def measure(nats_url: str, model: str, idle_s: float = 2.0, max_tokens: int = 8,
                  transport: str = "ucx") -> dict:
    """Runs one warm-up request, an idle window, the counted request, another idle window."""
    from moemesh.services.decode.config import DecodeConfig
    from moemesh.services.decode.service import DecodeService
    from moemesh.services.gateway.config import GatewayConfig
    from moemesh.services.gateway.service import GatewayService
    from moemesh.services.prefill.config import PrefillConfig
    from moemesh.services.prefill.service import PrefillService

    factory = None
    if transport == "loopback":
        from moemesh.shared.transport.loopback import LoopbackHub, LoopbackTransport
        hub = LoopbackHub()
        factory = lambda: LoopbackTransport(hub)  # noqa: E731
    common = dict(nats_url=nats_url, model=model, subject_prefix="rf", served_model_name="tiny",
                  heartbeat_interval_s=0.4, staging_mb=16, num_kv_blocks=256)
    rec = EdgeRecorder()
    rec.install()  # before the services start, so that their threads carry the hook
    try:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(PrefillService(PrefillConfig(worker_id="prefill-rf", **common), None, factory))
            await stack.enter_async_context(DecodeService(DecodeConfig(worker_id="decode-rf", **common), None, factory))
            gw = await stack.enter_async_context(GatewayService(GatewayConfig(
                nats_url=nats_url, model=model, subject_prefix="rf", served_model_name="tiny", port=0,
                worker_id="gw-rf")))
            url = f"http://127.0.0.1:{gw.port}"
            await _ready(url)
            await _chat(url, max_tokens)  # first-call work (imports, caches) stays out of the count
            await asyncio.sleep(0.5)
            rec.on = True
            await asyncio.sleep(idle_s)
            idle = rec.take()
            t0 = time.perf_counter()
            await _chat(url, max_tokens)
            await asyncio.sleep(0.3)  # the workers' release and the gateway's span end
            request_s = time.perf_counter() - t0
            request = rec.take()
            await asyncio.sleep(idle_s)
            idle |= rec.take()
            rec.on = False
    finally:
        rec.remove()
    files = request_files(request, idle)
    return {"bench": "request_files", "transport": transport, "num_files": len(files), "files": files,
            "idle_s": idle_s, "request_s": round(request_s, 3), "num_idle_edges": len(idle),
            "num_request_edges": len(request)}


def report(result: dict) -> str:
    lines = [f"{result['num_files']} project files on one streamed chat request ({result['transport']}):"]
    lines += [f"{i:3d}. {f}" for i, f in enumerate(result["files"], 1)]
    by_top: dict[str, int] = {}
    for f in result["files"]:
        top = "/".join(f.split("/")[:2])
        by_top[top] = by_top.get(top, 0) + 1
    lines.append("by folder: " + ", ".join(f"{k} {v}" for k, v in sorted(by_top.items())))
    return "\n".join(lines)


def run(model: str | None, out: str | None, transport: str = "ucx") -> dict:
    """Starts nats-server on a free port, measures, prints and saves the result."""
    import json
    import tempfile

    from moemesh.tools.launch.nats_server import start_nats
    from moemesh.tools.launch.procs import ProcessGroup, free_port

    if model is None:
        from moemesh.tools.launch.up import ensure_tiny_model
        model = str(ensure_tiny_model(Path.home() / ".cache" / "moemesh"))
    with tempfile.TemporaryDirectory() as tmp:
        group = ProcessGroup(Path(tmp))
        port = free_port()
        try:
            start_nats(group, port)
            result = asyncio.run(measure(f"nats://127.0.0.1:{port}", model, transport=transport))
        finally:
            group.stop()
    print(report(result))
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return result
