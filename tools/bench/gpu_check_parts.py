"""The parts of the GPU check (gpu_check.py), in the order they run: what each runs on a GPU
and on a CPU (`--cpu`, and smaller with `--quick`), how long it may take, and how its
output is read into a verdict and a one-line summary.

A part is one or more steps, each a process of its own, so that a part that crashes or
hangs (a CUDA fault, a stuck collective) is killed at its time limit and the next part
still runs. Each step writes a JSON file under the output directory; a step whose JSON
carries a "verdict" (pass / fail / skipped) says its own, otherwise its exit status does.
This module imports nothing heavy: the check may have to install torch before any part
can import it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HBM_BYTES_PER_S = 4.8e12  # the H200's, as kernels_gpu.Hardware records it
BF16_ON_CPU = "the Triton interpreter computes bf16 wrongly (tests/kernels/cases.py): it runs on CUDA only"


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]  # after the interpreter
    max_s: float  # the most it may take
    floor_s: float  # kept for it while the steps before it run
    env: tuple[tuple[str, str], ...] = ()
    budgeted: bool = True  # False: outside the check's overall time (the install)


@dataclass
class StepRun:
    argv: list[str]
    rc: int | None = None  # None: it did not run, or was killed
    seconds: float = 0.0
    timeout_s: float = 0.0
    timed_out: bool = False
    not_run: str = ""  # why it did not run


@dataclass
class Verdict:
    verdict: str  # pass | fail | skipped
    reason: str = ""
    summary: str = ""
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Mode:
    cpu: bool
    quick: bool
    out: Path
    work: Path  # the models the parts share

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"

    def model(self, name: str) -> str:
        return str(self.work / name)


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    steps: tuple[Step, ...]
    read: Callable[[Mode, list[StepRun]], Verdict]


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def process_verdict(runs: list[StepRun], log: str) -> Verdict | None:
    """A fail for the first step that timed out, did not run or exited non-zero; None if all exited 0."""
    for r in runs:
        what = " ".join(r.argv[1:4])
        if r.not_run:
            return Verdict("fail", f"{what}: not run ({r.not_run})")
        if r.timed_out:
            return Verdict("fail", f"{what}: timed out after {r.timeout_s:.0f} s (see {log})")
        if r.rc != 0:
            return Verdict("fail", f"{what}: exit status {r.rc} (see {log})")
    return None


def own_verdict(path: Path, runs: list[StepRun], log: str) -> Verdict:
    """The verdict a step wrote into its JSON, overruled by a step that failed as a process."""
    doc = _json(path)
    if doc is not None and "verdict" in doc:
        v = Verdict(doc["verdict"], doc.get("reason", ""), doc.get("summary", ""))
        failed = process_verdict(runs, log)
        if failed and v.verdict == "pass":
            return Verdict("fail", failed.reason, v.summary)
        return v
    return process_verdict(runs, log) or Verdict("fail", f"{path.name} was not written (see {log})")


# What the parts write, besides <part>.log: cleared before a run, so that nothing is read
# from an earlier one.
OUTPUTS = ("summary.json", "summary.txt", "env.json", "env-install.json", "kernels.json", "engine.json", "graphs.json",
           "launches.json", "bench_gpu.json", "mesh.json", "mesh-logs")


def _mod(module: str, *args: str) -> tuple[str, ...]:
    return ("-m", module, *args)


def env_part(m: Mode) -> Part:
    out = m.out
    steps = [] if m.cpu else [Step(_mod("moemesh.tools.bench.gpu_env", "--install", "--out", str(out / "env-install.json")),
                                   900, 0, budgeted=False)]
    record = () if m.cpu else ("--install-record", str(out / "env-install.json"))
    steps.append(Step(_mod("moemesh.tools.bench.gpu_env", "--device", m.device, *record, "--out", str(out / "env.json"),
                           "--models", str(m.work)), 120, 30))  # and the random checkpoints the later parts share
    return Part("env", "versions of torch, CUDA, Triton and the driver; the GPU; what was installed", tuple(steps),
                lambda m, runs: own_verdict(m.out / "env.json", runs, "env.log"))


def kernels_part(m: Mode) -> Part:
    pytest = ("-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=")
    if not m.cpu:
        return Part("kernels", "every kernel against its torch reference, compiled, in fp32, fp16 and bf16",
                    (Step((*pytest, "-m", "gpu", "tests/kernels"), 200, 90),), read_kernels)
    files = ("tests/kernels/test_rmsnorm.py", "tests/kernels/test_swiglu.py") if m.quick else ("tests/kernels",)
    step = Step((*pytest, "-m", "not slow", "-k", "cpu-fp32 or cpu-fp16", *files), 60, 15, (("TRITON_INTERPRET", "1"),))
    return Part("kernels", "every kernel against its torch reference, interpreted, in fp32 and fp16", (step,),
                read_kernels)


_TEST_RESULT = re.compile(r"^(?P<test>\S+::\S+) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_TEST_DTYPE = re.compile(r"\b(?:cpu|cuda)-(fp32|fp16|bf16)\b")


def read_pytest_log(text: str) -> dict:
    """pytest -v's results by dtype (the test id's cpu-fp32 ... cuda-bf16; "other" for
    tests without one), and the tests that failed."""
    by_dtype: dict[str, Counter] = {}
    failed = []
    for line in text.splitlines():
        hit = _TEST_RESULT.match(line)
        if not hit:
            continue
        dtype = _TEST_DTYPE.search(hit["test"])
        by_dtype.setdefault(dtype[1] if dtype else "other", Counter())[hit["outcome"].lower()] += 1
        if hit["outcome"] in ("FAILED", "ERROR"):
            failed.append(hit["test"])
    return {"by_dtype": {k: dict(v) for k, v in sorted(by_dtype.items())}, "failed": failed}


def read_kernels(m: Mode, runs: list[StepRun]) -> Verdict:
    """Reads kernels.log into kernels.json. pytest's -v lines are read, not its exit
    status alone, so that a run killed at its time limit still counts what it did."""
    log = m.out / "kernels.log"
    doc = read_pytest_log(log.read_text(errors="replace") if log.exists() else "")
    if m.cpu:
        doc["by_dtype"]["bf16"] = {"skipped": BF16_ON_CPU}
    ran = sum(n for c in doc["by_dtype"].values() for k, n in c.items() if k in ("passed", "failed", "error"))
    summary = "; ".join(f"{d} " + ", ".join(f"{k} ({n})" if k == "skipped" and isinstance(n, str) else f"{n} {k}"
                                            for k, n in c.items()) for d, c in doc["by_dtype"].items())
    v = process_verdict(runs, "kernels.log")
    if doc["failed"]:
        v = Verdict("fail", f"{len(doc['failed'])} failed, e.g. {doc['failed'][0]}")
    elif v is None and not ran:
        v = Verdict("fail", "no kernel test ran (see kernels.log)")
    v = v or Verdict("pass")
    v.summary = summary
    (m.out / "kernels.json").write_text(json.dumps(doc | {"verdict": v.verdict, "reason": v.reason,
                                                          "summary": summary, "log": "kernels.log"}, indent=1))
    return v


def engine_part(m: Mode) -> Part:
    size = ("--num-prompts", "4", "--new-tokens", "8") if m.quick else ("--num-prompts", "16") if m.cpu else ()
    step = Step(_mod("moemesh.tools.bench.engine_gpu", "--models", f"tiny={m.model('tiny')},v4-tiny={m.model('v4-tiny')}",
                     "--device", m.device, "--out", str(m.out / "engine.json"), *size),
                *((60, 15) if m.cpu else (150, 60)))
    return Part("engine", "tiny and v4-tiny greedy ids: fp32 on the device = CPU; bf16 against transformers' own",
                (step,), lambda m, runs: own_verdict(m.out / "engine.json", runs, "engine.log"))


def graphs_part(m: Mode) -> Part:
    tiny = m.model("tiny")
    graphs = _mod("moemesh.tools.bench.graphs_gpu", "--model", tiny, "--out", str(m.out / "graphs.json"),
                  *(("--smoke",) if m.cpu else ()))
    size = ("--batch-sizes", "1") if m.cpu else ("--batch-sizes", "1,16,64")
    size += ("--context-len", "31", "--prefill-len", "16") if m.quick else ()
    launches = _mod("moemesh.tools.cli.main", "bench", "launches", "--model", tiny, "--device", m.device, *size,
                    "--out", str(m.out / "launches.json"))
    steps = (Step(graphs, 40, 10), Step(launches, 40, 10)) if m.cpu else (Step(graphs, 120, 45), Step(launches, 60, 20))
    what = "decode graphs: replay = the same path run op by op; host time per step; launches per decode step"
    return Part("graphs", what, steps, read_graphs)


def read_graphs(m: Mode, runs: list[StepRun]) -> Verdict:
    graphs, launches = _json(m.out / "graphs.json") or {}, _json(m.out / "launches.json")
    said = []
    for name, sec in graphs.get("sections", {}).items():
        if not sec["ok"]:
            said.append(f"{name}: {sec['error']}")
        elif name.startswith("exactness"):
            r = sec["result"]
            said.append(f"{r['dtype']} replay {'=' if r['graph_equals_eager'] else '!='} eager, "
                        f"{r['tokens_equal_to_dynamic']}/{r['requests']} answers = dynamic")
        else:
            said += [f"outside the forward ({mode}) " + ", ".join(f"B={x['batch']} {x['outside_forward_ms']:.2f} ms"
                                                                  for x in rows) for mode, rows in sec["result"].items()]
    if launches:
        said.append("launches per decode step " + ", ".join(f"B={d['batch']} {d['launches']}" for d in launches["decode"]))
    v = process_verdict(runs, "graphs.log") or Verdict("pass")
    v.summary = "; ".join(said)
    return v


def roofline_part(m: Mode) -> Part:
    args = ["--out", str(m.out / "bench_gpu.json"), "--budget-s", "30" if m.cpu else "120"]
    args += ["--smoke"] if m.cpu else []
    args += ["--no-forward"] if m.quick else []
    env = (("TRITON_INTERPRET", "1"),) if m.cpu else ()
    step = Step(_mod("moemesh.tools.bench.kernels_gpu", *args), 40 if m.cpu else 180, 10 if m.cpu else 60, env)
    what = "each kernel timed against the HBM and compute roofline; bench forward's decode sweep"
    return Part("roofline", what, (step,), read_roofline)


def read_roofline(m: Mode, runs: list[StepRun]) -> Verdict:
    doc = _json(m.out / "bench_gpu.json") or {}
    rows = [r for r in doc.get("kernels", []) if "triton_ms" in r]
    said = [f"{len(rows)} kernel cases timed, largest difference from torch "
            f"{max((r['max_abs_err'] for r in rows), default=0):.1e}"]
    said += [f"{r['op']}: {r.get('error') or r.get('skipped')}" for r in doc.get("kernels", []) if "triton_ms" not in r]
    for op in ([] if m.cpu else ["fused_moe", "mla_decode"]):
        best = max((r for r in rows if r["op"] == op), key=lambda r: r["achieved_gb_per_s"], default=None)
        if best:
            said.append(f"{op} up to {best['achieved_gb_per_s'] * 1e9 / HBM_BYTES_PER_S:.0%} of HBM "
                        f"({best['achieved_gb_per_s']:.0f} GB/s at {best['shape']})")
    fwd = doc.get("forward")
    if fwd:
        said.append("forward sweep " + (f"{fwd['preset']} B=" + ",".join(str(r["batch"]) for r in fwd["triton"])
                                        if "triton" in fwd else str(fwd.get("error") or fwd.get("skipped"))))
    v = process_verdict(runs, "roofline.log") or Verdict("pass")
    v.summary = "; ".join(said)
    return v


def mesh_part(m: Mode) -> Part:
    args = ("--model", m.model("tiny"), "--device", m.device, "--log-dir", str(m.out / "mesh-logs"),
            "--out", str(m.out / "mesh.json"), "--ready-timeout", "90")
    # 90 s to come up on a CPU too: alone it takes about 6, but beside a full test suite on
    # two cores the workers once took 46 s to log their first line, and 45 failed the part.
    step = Step(_mod("moemesh.tools.bench.mesh_gpu", *args), 110 if m.cpu else 150, 15 if m.cpu else 60)
    what = "moemesh up on the device: a streamed chat completion, its P/D hand-off, the UCX transports"
    return Part("mesh", what, (step,), lambda m, runs: own_verdict(m.out / "mesh.json", runs, "mesh.log"))


def all_parts(m: Mode) -> list[Part]:
    return [env_part(m), kernels_part(m), engine_part(m), graphs_part(m), roofline_part(m), mesh_part(m)]
