"""`moemesh bench gateway-start`: what starting a gateway costs, against a real nats-server.

Per run, in a fresh process each time:
    import   wall time of importing the gateway's entry module (what `python -m` loads)
    start    from process start until GET /health answers
    rss      the gateway's resident memory once it answers
Medians over `runs`. The gateway only routes: it must not load torch or the engine
(`torch_loaded` says whether the import did).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from moemesh.tools.bench.env import environment
from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port
from moemesh.tools.launch.up import default_home, ensure_tiny_model

ENTRY = "moemesh.services.gateway.__main__"
_IMPORT = (f"import sys, time; t = time.perf_counter(); import {ENTRY}; "
           "print(time.perf_counter() - t, 'torch' in sys.modules)")


@dataclass(frozen=True)
class GatewayStartConfig:
    model: str = ""  # empty: the tiny model (the gateway reads only its tokenizer and config)
    runs: int = 5
    timeout_s: float = 60.0


def import_once() -> tuple[float, bool]:
    out = subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), out[1] == "True"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_once(model: str, nats_url: str, timeout_s: float) -> tuple[float, float]:
    """(seconds until /health answers, RSS in MiB then)."""
    port = free_port()
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "moemesh.services.gateway", "--model", model, "--nats-url", nats_url,
                          "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"gateway exited with {p.returncode}: {p.stderr.read().decode()[-2000:]}")
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"gateway did not answer /health within {timeout_s:.0f}s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.005)  # a bench polling a child it started; the gateway is not waiting on this
        return time.perf_counter() - t0, rss_mib(p.pid)
    finally:
        p.terminate()
        p.wait(10)


def run(cfg: GatewayStartConfig) -> dict:
    model = cfg.model or str(ensure_tiny_model(default_home()))
    imports = [import_once() for _ in range(cfg.runs)]
    group = ProcessGroup(default_home() / "runs" / time.strftime("gateway-start-%Y%m%d-%H%M%S"))
    port = free_port()
    try:
        start_nats(group, port)
        starts = [start_once(model, f"nats://127.0.0.1:{port}", cfg.timeout_s) for _ in range(cfg.runs)]
    finally:
        group.stop()
    return {
        "bench": "gateway-start", "config": asdict(cfg), "env": environment(),
        "import_s": statistics.median(s for s, _ in imports), "start_s": statistics.median(s for s, _ in starts),
        "rss_mib": statistics.median(m for _, m in starts), "torch_loaded": any(t for _, t in imports),
        "runs": {"import_s": [s for s, _ in imports], "start_s": [s for s, _ in starts],
                 "rss_mib": [m for _, m in starts]},
    }


def table(r: dict) -> str:
    return (f"gateway import {r['import_s'] * 1e3:7.0f} ms   start to /health {r['start_s'] * 1e3:7.0f} ms   "
            f"RSS {r['rss_mib']:6.1f} MiB   torch loaded: {'YES' if r['torch_loaded'] else 'no'}"
            f"   (medians of {r['config']['runs']})")
