"""`python -m moemesh.tools.bench.gpu_env`: what the GPU check runs on, and (--install) what
it needs installed first.

--install (on a GPU machine only; `gpu-check --cpu` never installs): when torch is missing
or is a CPU build, torch is installed from the range in pyproject.toml (PyPI's Linux wheel
is the CUDA build, where scripts/setup-env pins the CPU one), then this checkout,
editable, with the kernels extra and those of the test extra's packages that the check
runs (pytest and its timeout plugin, hypothesis, transformers, the openai client). A
CUDA torch already there means nothing is installed. The commands and their time are
recorded (--out).

Without --install: torch, CUDA, Triton and driver versions, the GPU's name and memory,
and the other libraries the check uses, as JSON with a verdict (--out). --install-record
merges the install step's record in.

Nothing here imports torch before the install is done: a process that had imported a
CPU torch could not see the CUDA one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from moemesh.tools.bench.env import package_version

ROOT = Path(__file__).resolve().parents[2]
# The test extra's packages the check runs; the rest of it (lm_eval, guidellm, ...) it does not.
CHECK_PACKAGES = ("pytest", "pytest-timeout", "hypothesis", "transformers", "openai")
_PROBE = "import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda}))"


def probe_torch(python: str) -> dict | None:
    """The torch an interpreter imports ({'version', 'cuda'}), or None when it has none."""
    res = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    return json.loads(res.stdout.splitlines()[-1]) if res.returncode == 0 and res.stdout.strip() else None


def requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()


def install_plan(pyproject: dict, torch_found: dict | None, root: Path) -> list[list[str]]:
    """pip arguments to run, in order; [] when a CUDA torch is there already."""
    if torch_found is not None and torch_found.get("cuda"):
        return []
    project = pyproject["project"]
    torch_req = next(r for r in project["dependencies"] if requirement_name(r) == "torch")
    test = [r for r in project["optional-dependencies"]["test"] if requirement_name(r) in CHECK_PACKAGES]
    plan = [["uninstall", "-y", "torch"]] if torch_found is not None else []
    return plan + [["install", torch_req], ["install", "-e", f"{root}[kernels]", *test]]


def install(python: str, root: Path = ROOT) -> dict:
    t0 = time.monotonic()
    found = probe_torch(python)
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    plan = install_plan(pyproject, found, root)
    record: dict = {"torch_found": found, "needed": bool(plan), "commands": [], "ok": True}
    for args in plan:
        argv = [python, "-m", "pip", *args, "--disable-pip-version-check"]
        t = time.monotonic()
        res = subprocess.run(argv, capture_output=True, text=True)
        record["commands"].append({"argv": argv, "rc": res.returncode, "seconds": round(time.monotonic() - t, 1),
                                   "tail": (res.stdout + res.stderr)[-2000:]})
        if res.returncode != 0:
            record["ok"] = False
            break
    record["torch_after"] = probe_torch(python) if plan else found
    record["seconds"] = round(time.monotonic() - t0, 1)
    return record


def nvidia_smi() -> dict | None:
    """The driver's own account of the GPUs (None: no nvidia-smi, or it failed)."""
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    rows = [[c.strip() for c in line.split(",")] for line in res.stdout.splitlines() if line.strip()]
    return {"driver": rows[0][1] if rows else None, "gpus": [{"name": r[0], "memory": r[2]} for r in rows]}


def report(device: str) -> dict:
    import torch

    info: dict = {
        "python": sys.version.split()[0], "executable": sys.executable, "device": device,
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "triton": package_version("triton"), "transformers": package_version("transformers"),
        "openai": package_version("openai"),
        "ucxx": package_version("ucxx-cu12") or package_version("ucxx"), "libucx": package_version("libucx-cu12"),
        "moemesh_root": str(ROOT), "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "nvidia_smi": nvidia_smi(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                       "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                       "count": torch.cuda.device_count()}
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def verdict(info: dict, install_record: dict | None) -> tuple[str, str, str]:
    """(verdict, reason, one-line summary)."""
    gpu = info.get("gpu")
    driver = (info.get("nvidia_smi") or {}).get("driver")
    where = f"{gpu['name']} ({gpu['memory_gib']} GiB), driver {driver}" if gpu else "no GPU"
    summary = f"torch {info['torch']}, CUDA {info['cuda'] or 'none'}, Triton {info['triton']}, {where}"
    if install_record and install_record.get("needed"):
        summary += f"; installed in {install_record['seconds']:.0f} s"
    reasons = []
    if install_record and not install_record.get("ok", True):
        reasons.append("the install failed (env-install.json)")
    if info["triton"] is None:
        reasons.append("triton is not installed")
    if info["device"].startswith("cuda") and not info["cuda_available"]:
        reasons.append(f"torch {info['torch']} sees no CUDA device")
    return ("fail" if reasons else "pass"), "; ".join(reasons), summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_env", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="what the check runs on: cuda, or cpu")
    ap.add_argument("--install", action="store_true", help="install what is missing (never with --device cpu)")
    ap.add_argument("--install-record", default="", help="the --install step's JSON, to merge in")
    ap.add_argument("--out", default="env.json")
    ap.add_argument("--models", default="", help="then make the random checkpoints the later parts share here "
                                                  f"({', '.join(MODELS)}, seed 0)")
    a = ap.parse_args(argv)
    if a.install:
        if a.device == "cpu":
            ap.error("--install is for a GPU machine: on a CPU nothing is installed")
        record = install(sys.executable)
        Path(a.out).write_text(json.dumps(record, indent=1))
        print(f"install: {'needed' if record['needed'] else 'nothing to do'}, {record['seconds']} s, ok={record['ok']}")
        return 0 if record["ok"] else 1
    record = json.loads(Path(a.install_record).read_text()) if a.install_record and Path(a.install_record).exists() \
        else None
    try:
        info = report(a.device)
    except ImportError as e:  # torch missing (and not installed): the later parts cannot run either
        info = {"device": a.device, "error": f"{type(e).__name__}: {e}"}
        Path(a.out).write_text(json.dumps(info | {"verdict": "fail", "reason": info["error"], "summary": ""}))
        print(f"FAIL: {info['error']}")
        return 1
    result = {**info, "install": record or {"needed": False, "why": "no install record (--cpu never installs)"}}
    result["verdict"], result["reason"], result["summary"] = verdict(info, record)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(result["summary"] + (f"\nFAIL: {result['reason']}" if result["reason"] else ""))
    made = make_models(Path(a.models)) if a.models else True
    return 0 if result["verdict"] == "pass" and made else 1


# Made here, in the process that has torch imported already, not by one `moemesh
# init-model` each: every process start pays for torch and transformers again (12 s of
# the CPU check's 19 s of environment, here).
MODELS = ("tiny", "v4-tiny")


def make_models(work: Path) -> bool:
    from moemesh.shared.checkpoint.writer import init_model

    for name in MODELS:
        t0 = time.monotonic()
        try:
            init_model(work / name, name, seed=0)
        except Exception as e:  # the parts that need it say so too; this names the cause
            print(f"FAIL: making the {name} checkpoint: {type(e).__name__}: {e}")
            return False
        print(f"wrote the {name} checkpoint to {work / name} in {time.monotonic() - t0:.1f} s")
    return True


if __name__ == "__main__":
    sys.exit(main())
