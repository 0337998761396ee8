"""`scripts/gpu-check`: the prepared GPU check, one command (docs/kernels.md).

    scripts/gpu-check [--out DIR]        on a CUDA machine: 8 minutes at most on an H200
    scripts/gpu-check --cpu [--quick]    the same parts on a CPU, to test the plumbing

Six parts run in order (gpu_check_parts.py): env, kernels, engine, graphs, roofline,
mesh. Each step of a part is a process of its own with a time limit, so a part that
fails or hangs costs only its own time. The limits fit the whole check in --budget-s:
a step may run for its own most, but never into the time kept for the steps after it.
Installing torch (on a GPU machine without a CUDA build) is outside the budget, and
its time is recorded.

The output directory gets each part's log (<part>.log) and JSON, summary.json (every
part's verdict, reason, summary and steps) and summary.txt (one line per part). The
exit status is 1 when a part failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from moemesh.tools.bench.gpu_check_parts import OUTPUTS, Mode, Part, Step, StepRun, Verdict, all_parts

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = {"gpu": 480.0, "cpu": 180.0}
KILL_GRACE_S = 5.0  # between SIGTERM and SIGKILL of a step's process group
MIN_STEP_S = 3.0  # a step that would get less than this is not started


def step_env(cpu: bool, extra: tuple[tuple[str, str], ...]) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not cpu:
        env.pop("TRITON_INTERPRET", None)  # left over from a CPU run, it would make the kernels interpret
    return env | dict(extra)


def run_step(python: str, step: Step, env: dict[str, str], log, timeout_s: float) -> StepRun:
    """Runs one step in a process group of its own. At its limit the whole group (a mesh's
    workers too) gets SIGTERM, then SIGKILL; whatever a step leaves behind is ended too."""
    argv = [python, *step.argv]
    run = StepRun(argv, timeout_s=round(timeout_s, 1))
    if timeout_s < MIN_STEP_S:
        run.not_run = "the check's time budget was spent"
        return run
    log.write(f"\n$ {shlex.join(argv)}   (limit {timeout_s:.0f} s)\n".encode())
    log.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    try:
        run.rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        run.timed_out = True
    _end_group(proc)
    run.seconds = round(time.monotonic() - t0, 1)
    return run


def _end_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


class Clock:
    """The check's budget: a step's limit is its own most, cut to leave the later steps'
    floors; a step outside the budget moves the deadline by what it took."""

    def __init__(self, budget_s: float, parts: list[Part]):
        self.deadline = time.monotonic() + budget_s
        self._floors = [s.floor_s for p in parts for s in p.steps if s.budgeted]

    def limit(self, step: Step) -> float:
        if not step.budgeted:
            return step.max_s
        self._floors.pop(0)
        left = self.deadline - time.monotonic() - sum(self._floors) - KILL_GRACE_S
        return max(0.0, min(step.max_s, left))

    def spent_outside(self, run: StepRun) -> None:
        self.deadline += run.seconds


def run_part(python: str, part: Part, mode: Mode, clock: Clock) -> dict:
    t0 = time.monotonic()
    runs = []
    with open(mode.out / f"{part.name}.log", "wb") as log:
        for step in part.steps:
            run = run_step(python, step, step_env(mode.cpu, step.env), log, clock.limit(step))
            if not step.budgeted:
                clock.spent_outside(run)
            runs.append(run)
    if all(r.not_run for r in runs):
        v = Verdict("skipped", runs[0].not_run)
    else:
        try:
            v = part.read(mode, runs)
        except Exception as e:  # noqa: BLE001 - a result that cannot be read fails its part, not the check
            v = Verdict("fail", f"its results could not be read: {type(e).__name__}: {e}")
    return {"what": part.what, "verdict": v.verdict, "reason": v.reason, "summary": v.summary,
            "seconds": round(time.monotonic() - t0, 1), "log": f"{part.name}.log", "steps": [asdict(r) for r in runs]}


def summary_text(doc: dict) -> str:
    counts = {k: sum(p["verdict"] == k for p in doc["parts"].values()) for k in ("pass", "fail", "skipped")}
    head = (f"moemesh gpu-check on {doc['device']}{' (quick)' if doc['quick'] else ''}, {doc['started']}: "
            + ", ".join(f"{n} {k}" for k, n in counts.items()) + f", in {doc['seconds']:.0f} s")
    lines = [head]
    for name, p in doc["parts"].items():
        why = f" -- {p['reason']}" if p["reason"] else ""
        lines.append(f"{name:<9} {p['verdict']:<7} {p['seconds']:>4.0f} s  {p['summary']}{why}")
    return "\n".join(lines) + "\n"


def run_check(mode: Mode, python: str, budget_s: float, parts: list[Part] | None = None) -> dict:
    """Runs the parts (by default all of them) in order; returns what summary.json holds."""
    parts = all_parts(mode) if parts is None else parts
    clock = Clock(budget_s, parts)
    t0 = time.monotonic()
    doc = {"device": mode.device, "quick": mode.quick, "budget_s": budget_s, "python": python,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parts": {}}
    for part in parts:
        doc["parts"][part.name] = p = run_part(python, part, mode, clock)
        print(f"{part.name}: {p['verdict']} ({p['seconds']:.0f} s) {p['summary']}"
              + (f" -- {p['reason']}" if p["reason"] else ""), flush=True)
    doc["seconds"] = round(time.monotonic() - t0, 1)
    return doc


def clear(out: Path) -> None:
    """Removes what an earlier run wrote into out (and nothing else)."""
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out", help="output directory")
    ap.add_argument("--cpu", action="store_true", help="run on this CPU: interpreter, small sizes, device=cpu")
    ap.add_argument("--quick", action="store_true", help="with --cpu: the smallest sizes (the test suite's run)")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole check's time (default 480 s, --cpu 180 s)")
    a = ap.parse_args(argv)
    if a.quick and not a.cpu:
        ap.error("--quick is for --cpu runs: on a GPU the check runs whole")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    clear(out)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        doc = run_check(Mode(a.cpu, a.quick, out, work), sys.executable,
                        a.budget_s or BUDGET_S["cpu" if a.cpu else "gpu"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps(doc, indent=1))
    (out / "summary.txt").write_text(summary_text(doc))
    print(f"\n{summary_text(doc)}results in {out}")
    return 1 if any(p["verdict"] == "fail" for p in doc["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
