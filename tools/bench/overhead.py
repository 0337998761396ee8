"""What the host-overhead benchmarks share (`bench stream`, `bench decode --mock-step-ms`):
the load client in its own process, CPU per output token of each mesh process, and the
decode worker's step figures over a point's load window.

Glossary:
- ideal rate: streams × 1000 / mock_step_ms tokens/s. The mock engine gives every running
  sequence one token per step of exactly mock_step_ms, so no mesh can do better.
- share of ideal: measured tokens/s over the ideal rate.
- mesh CPU: CPU seconds of the gateway, prefill, decode and nats processes (each with its
  descendants) over the client's load window; per token, over the tokens the client got.
  The client's own CPU is reported apart and never counted in the mesh.
- host (of a decode step): the engine's CPU work outside the forward; exposed: the part of
  it the device waited for; hidden share: 1 − Σexposed / Σhost over the window's steps.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from moemesh.tools.bench.env import percentile
from moemesh.tools.launch.up import Mesh

MESH_ROLES = ("gateway", "prefill", "decode", "nats")


def role_of(process_name: str) -> str:
    """A mesh child's role: "decode-0" and "decode-i0-r1" are both "decode"."""
    return process_name.split("-", 1)[0]


def mesh_pids(mesh: Mesh) -> dict[str, int]:
    return {c.name: c.popen.pid for c in mesh.group.children}


def run_client(url: str, model: str, streams: int, seconds: float, max_tokens: int, step_ms: float, *,
               chat: bool = False, prompt_tokens: int = 0, pids: dict[str, int] | None = None) -> dict:
    """Run `moemesh.tools.bench.sse_client` as a subprocess and return its result line.

    Args:
        step_ms: the mock step time, only to bound how long the client may take.
        pids: name -> pid of processes whose CPU the client measures over its load window.
    Raises:
        RuntimeError: the client failed or printed no result.
    """
    argv = [sys.executable, "-m", "moemesh.tools.bench.sse_client", "--url", url, "--model", model,
            "--streams", str(streams), "--seconds", str(seconds), "--max-tokens", str(max_tokens)]
    if chat:
        argv.append("--chat")
    if prompt_tokens:
        argv += ["--prompt-tokens", str(prompt_tokens)]
    if pids:
        argv += ["--cpu-pids", ",".join(f"{n}={p}" for n, p in pids.items())]
    # The deadline, then the requests in flight (a few times their ideal length), then slack.
    timeout = seconds + 4 * max_tokens * step_ms / 1e3 + 120
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"load client exited with code {r.returncode}:\n{r.stderr[-2000:]}")
    return json.loads(lines[-1])


def decode_steps(mesh: Mesh) -> list[list[float]]:
    """The single decode worker's recent step rows (see WorkerStats.recent_steps)."""
    return decode_state(mesh, 1)[1]


def decode_state(mesh: Mesh, dep: int) -> tuple[float | None, list[list[float]]]:
    """(the DEP instance's balance ratio over its recent load window, None for one worker;
    the recent step rows of its rank 0, or of the single decode worker)."""
    from moemesh.tools.bench.phases import instance_state

    return asyncio.run(instance_state(mesh, dep))


def step_figures(steps: list[list[float]], t0: float, t1: float) -> dict:
    """Medians over the steps that ended in [t0, t1] (wall clock), and the hidden share of host.

    A row is [time, total_s, forward_s, host_s, rank_wait_s, loop_gap_s, num_seqs,
    host_exposed_s, drafts_accepted, device_skew_s]; older workers leave out the last ones,
    and then their figures are None. rank wait beyond the slowest rank: a mock DEP rank's
    rank wait less the slower ranks' own device time (device_skew_s), which it waited for
    as any rank waits for the slowest: what the lockstep adds on top. The worker keeps its last 4096 steps only: at short steps,
    the window's end. tokens_per_seq_step: what a running sequence gained a step (1, and
    with drafts the accepted ones on top). device_step_ms_mean: the mean step the device
    itself set, its own step plus the slower ranks' (forward + device_skew), which a host
    that cost nothing would still wait for: on a mock DEP rank, what each step's routing
    draw dictates.
    """
    sel = [s for s in steps if t0 <= s[0] <= t1]
    if not sel:
        return {"steps": 0}
    out = {"steps": len(sel), "step_ms_p50": percentile([s[1] for s in sel], 50) * 1e3,
           "step_ms_mean": sum(s[1] for s in sel) / len(sel) * 1e3,
           "step_ms_p90": percentile([s[1] for s in sel], 90) * 1e3,
           "forward_ms_p50": percentile([s[2] for s in sel], 50) * 1e3,
           "host_ms_p50": percentile([s[3] for s in sel], 50) * 1e3,
           "host_ms_p99": percentile([s[3] for s in sel], 99) * 1e3,
           "num_seqs_p50": percentile([s[6] for s in sel], 50) if len(sel[0]) > 6 else None,
           "num_seqs_mean": sum(s[6] for s in sel) / len(sel) if len(sel[0]) > 6 else None,
           "host_exposed_ms_p50": None, "host_hidden_share": None, "tokens_per_seq_step": None,
           "rank_wait_ms_p50": percentile([s[4] for s in sel], 50) * 1e3, "rank_wait_beyond_ms_p50": None}
    if all(len(s) > 7 for s in sel):
        host, exposed = sum(s[3] for s in sel), sum(s[7] for s in sel)
        out["host_exposed_ms_p50"] = percentile([s[7] for s in sel], 50) * 1e3
        out["host_exposed_ms_p99"] = percentile([s[7] for s in sel], 99) * 1e3
        out["host_hidden_share"] = 1 - exposed / host if host > 0 else None
    if all(len(s) > 8 for s in sel):
        seqs = sum(s[6] for s in sel)
        out["tokens_per_seq_step"] = (seqs + sum(s[8] for s in sel)) / seqs if seqs else None
    if all(len(s) > 9 for s in sel):
        out["rank_wait_beyond_ms_p50"] = percentile([s[4] - s[9] for s in sel], 50) * 1e3
        out["device_step_ms_mean"] = sum(s[2] + s[9] for s in sel) / len(sel) * 1e3
    return out


def draft_gain(spec_tokens: int, accept_rate: float) -> float:
    """What a sequence gains a step with the mock's drafts: 1 + A + ... + A^K (drafts are
    accepted in order). Raises ValueError on flags out of range."""
    if not 0 <= spec_tokens <= 8 or not 0 <= accept_rate <= 1:
        raise ValueError("--spec-tokens must be in [0, 8] and --accept-rate in [0, 1]")
    return sum(accept_rate**j for j in range(spec_tokens + 1))


def point_row(res: dict, step_ms: float, roles: tuple[str, ...], steps: list[list[float]],
              tokens_per_step: float = 1.0, balance_ratio: float | None = None) -> dict:
    """One point of a host-overhead bench from the client's result and the decode steps.
    tokens_per_step: what a sequence gains a step (1; with mock drafts, 1 + A + ... + A^K).
    balance_ratio: a DEP instance's, over its load window at the point's end."""
    tokens = res["tokens"]
    cpu = {r: 0.0 for r in roles}
    for name, s in res["cpu_s"].items():
        if role_of(name) in cpu:
            cpu[role_of(name)] += s
    per_tok = {r: (s / tokens * 1e6 if tokens else None) for r, s in cpu.items()}
    per_tok["mesh"] = sum(cpu.values()) / tokens * 1e6 if tokens else None
    ideal = res["streams"] * tokens_per_step * 1e3 / step_ms
    st = step_figures(steps, res["started_at"], res["ended_at"])
    # The routing bound: the ideal at the step the device set (a mock DEP instance waits for
    # its busiest rank's draw every step, balanced routing too), and the share of it served.
    dev = st.get("device_step_ms_mean")
    bound = ideal * step_ms / dev if dev else None
    return {"streams": res["streams"], "wall_s": res["wall_s"], "tokens": tokens, "requests": res["requests"],
            "errors": res["errors"], "error_kinds": res["error_kinds"], "tokens_per_s": res["tokens_per_s"],
            "ideal_tokens_per_s": ideal, "share_of_ideal": res["tokens_per_s"] / ideal,
            "tokens_per_step": tokens_per_step,
            "ttft_ms_p50": res["ttft_ms_p50"], "ttft_ms_p99": res["ttft_ms_p99"], "cpu_s": cpu,
            "cpu_us_per_token": per_tok,
            "client_cpu_us_per_token": res["client_cpu_s"] / tokens * 1e6 if tokens else None,
            "balance_ratio": balance_ratio, "routing_bound_tokens_per_s": bound,
            "share_of_routing_bound": res["tokens_per_s"] / bound if bound else None,
            "decode_steps": st}


def table(rows: list[dict], roles: tuple[str, ...], label: str = "streams", extra: str = "") -> str:
    """Rows of point_row as text; `extra` names a string column each row may carry (e.g. "goal")."""
    short = {"gateway": "gw", "prefill": "pre", "decode": "dec", "nats": "nats"}
    cpu_head = "/".join(short[r] for r in roles) + "/mesh"
    dep = any(p.get("balance_ratio") is not None for p in rows)
    lines = [f"{label:>7} {'tok/s':>8} {'ideal':>8} {'share':>6} {'TTFT p50':>9}  {'CPU us/tok ' + cpu_head:>30} "
             f"{'client':>7}  {'step/host/exposed ms':>21} {'hidden':>6} {'tok/seq/step':>12} {'errors':>6}"
             + (f" {'wait/beyond ms':>14} {'balance':>7} {'bound':>6} {'of it':>6}" if dep else "")
             + (f"  {extra}" if extra else "")]
    for p in rows:
        us = p["cpu_us_per_token"]
        cpu = "/".join(_f(us[r]) for r in (*roles, "mesh"))
        st = p["decode_steps"]
        steps = "/".join(_f(st.get(k), ".2f") for k in ("step_ms_p50", "host_ms_p50", "host_exposed_ms_p50"))
        hidden = "-" if st.get("host_hidden_share") is None else f"{st['host_hidden_share']:.0%}"
        gain = _f(st.get("tokens_per_seq_step"), ".2f")
        lines.append(f"{p['streams']:>7} {p['tokens_per_s']:>8.0f} {p['ideal_tokens_per_s']:>8.0f} "
                     f"{p['share_of_ideal']:>6.3f} {_f(p['ttft_ms_p50']):>9}  {cpu:>30} "
                     f"{_f(p['client_cpu_us_per_token']):>7}  {steps:>21} {hidden:>6} {gain:>12} {p['errors']:>6}"
                     + (f" {_wait(st):>14} {_f(p.get('balance_ratio'), '.3f'):>7} {_bound(p):>6}"
                        f" {_f(p.get('share_of_routing_bound'), '.3f'):>6}" if dep else "")
                     + (f"  {p.get(extra, '')}" if extra else ""))
    return "\n".join(lines)


def _bound(p: dict) -> str:
    """The routing bound as a share of the ideal: the most this instance's steps allow."""
    b = p.get("routing_bound_tokens_per_s")
    return "-" if b is None else f"{b / p['ideal_tokens_per_s']:.3f}"


def _wait(st: dict) -> str:
    return f"{_f(st.get('rank_wait_ms_p50'), '.2f')}/{_f(st.get('rank_wait_beyond_ms_p50'), '.2f')}"


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)
