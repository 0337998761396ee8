"""The prepared GPU check (scripts/gpu-check) runs end to end on this CPU (--cpu --quick),
so that a GPU session finds every part's plumbing working; its runner, readers and the
install plan are checked on their own, without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from moemesh.tools.bench import engine_gpu, gpu_env, mesh_gpu
from moemesh.tools.bench.gpu_check import Clock, run_check
from moemesh.tools.bench.gpu_check_parts import Mode, Part, Step, all_parts, own_verdict, read_pytest_log

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["env", "kernels", "engine", "graphs", "roofline", "mesh"]
RESULTS = ["env.json", "kernels.json", "engine.json", "graphs.json", "launches.json", "bench_gpu.json", "mesh.json"]


def _gpu_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    return subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--cpu", "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=280)


def _check_cpu_run(out: Path, res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((out / "summary.json").read_text())
    assert list(doc["parts"]) == PARTS and doc["device"] == "cpu"
    for name, part in doc["parts"].items():
        assert part["verdict"] == "pass", (name, part["reason"])
        assert part["summary"] and (out / part["log"]).is_file()
        assert not any(s["timed_out"] or s["not_run"] or s["rc"] != 0 for s in part["steps"]), name
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [[p, "pass"] for p in PARTS]
    assert "6 pass, 0 fail, 0 skipped" in lines[0]
    for f in RESULTS:
        json.loads((out / f).read_text())
    # on a CPU: nothing installed, and no install step at all
    env = json.loads((out / "env.json").read_text())
    assert env["install"]["needed"] is False and env["cuda_available"] is False
    assert not any("--install" in s["argv"] for s in doc["parts"]["env"]["steps"])
    kernels = json.loads((out / "kernels.json").read_text())
    assert kernels["by_dtype"]["fp32"]["passed"] > 0 and kernels["by_dtype"]["fp16"]["passed"] > 0
    assert "interpreter" in kernels["by_dtype"]["bf16"]["skipped"] and not kernels["failed"]
    engine = json.loads((out / "engine.json").read_text())
    assert set(engine["models"]) == {"tiny", "v4-tiny"}
    for m in engine["models"].values():
        assert m["fp32_equal_to_cpu"] is True and m["fp32"]["equal"] == m["fp32"]["of"] > 0
        assert m["bf16"]["pass"] is None and 0 <= m["bf16"]["transformers_share"] <= 1  # measured, judged on a GPU
        assert m["sampled"]["lengths_ok"] and m["sampled"]["of"] > 0 and m["sampled"]["spec_tokens"] == 1
    mesh = json.loads((out / "mesh.json").read_text())
    assert mesh["stream"]["finish_reason"] == "length" and mesh["handoff"]["kv.transfer"][0]["bytes"] > 0
    assert {op["memory"] for ops in mesh["ucx"].values() for op in ops} == {"host"}
    return doc


@pytest.mark.timeout(300)
def test_cpu_quick_run_gives_every_part_a_verdict(tmp_path):
    out = tmp_path / "out"
    doc = _check_cpu_run(out, _gpu_check(out, "--quick"))
    assert doc["quick"] is True


@pytest.mark.slow  # the whole --cpu run (about a minute alone); the quick one above covers every part
@pytest.mark.timeout(300)
def test_cpu_full_run_gives_every_part_a_verdict(tmp_path):
    out = tmp_path / "out"
    doc = _check_cpu_run(out, _gpu_check(out))
    assert doc["quick"] is False


def _py(code: str, max_s: float = 30, floor_s: float = 1) -> Step:
    return Step(("-c", code), max_s, floor_s)


def _judge(m: Mode, runs) -> object:
    return own_verdict(m.out / "none.json", runs, "x.log")


@pytest.fixture
def short_grace(monkeypatch):
    """A second between SIGTERM and SIGKILL, and steps of a second start: a budget of a few seconds."""
    from moemesh.tools.bench import gpu_check

    monkeypatch.setattr(gpu_check, "KILL_GRACE_S", 1.0)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1.0)


def test_a_hanging_part_is_killed_with_its_children_and_the_next_part_runs(tmp_path, short_grace):
    pidfile = tmp_path / "child.pid"
    hang = ("import subprocess, time; p = subprocess.Popen(['sleep', '120']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    write = f"import json; json.dump({{'verdict': 'pass', 'summary': 'fine'}}, open({str(tmp_path / 'ok.json')!r}, 'w'))"
    parts = [Part("hang", "sleeps", (_py(hang, max_s=2),), _judge),
             Part("after", "writes its verdict", (_py(write),),
                  lambda m, runs: own_verdict(m.out / "ok.json", runs, "after.log"))]
    doc = run_check(Mode(True, True, tmp_path, tmp_path), sys.executable, 60, parts)
    hang_part, after = doc["parts"]["hang"], doc["parts"]["after"]
    assert hang_part["verdict"] == "fail" and "timed out after 2 s" in hang_part["reason"]
    assert hang_part["steps"][0]["timed_out"] and hang_part["seconds"] < 30
    child = int(pidfile.read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    assert after["verdict"] == "pass" and after["summary"] == "fine"


def test_a_part_failing_by_exit_status_and_one_out_of_budget(tmp_path, short_grace):
    # 4 s in all, 1 of them the kill grace: the hanging step is stopped at ~3 s, which
    # spends the budget, so the last part cannot start.
    parts = [Part("fails", "exits 3", (_py("raise SystemExit(3)", floor_s=0),), _judge),
             Part("hang", "sleeps", (_py("import time; time.sleep(60)", floor_s=0),), _judge),
             Part("late", "never starts", (_py("pass", floor_s=0),), _judge)]
    doc = run_check(Mode(True, True, tmp_path, tmp_path), sys.executable, 4, parts)
    assert doc["parts"]["fails"]["verdict"] == "fail" and "exit status 3" in doc["parts"]["fails"]["reason"]
    assert doc["parts"]["hang"]["verdict"] == "fail" and "timed out" in doc["parts"]["hang"]["reason"]
    assert doc["parts"]["late"]["verdict"] == "skipped" and "budget" in doc["parts"]["late"]["reason"]


def test_a_step_gets_its_most_but_leaves_the_later_steps_their_floors(tmp_path):
    steps = (Step(("a",), 200, 10), Step(("b",), 20, 30), Step(("c",), 5, 20, budgeted=False))
    clock = Clock(100, [Part("p", "", steps, _judge)])
    assert 64 < clock.limit(steps[0]) <= 65  # 100 - the next floor (30) - the kill grace (5)
    assert clock.limit(steps[1]) == 20 and clock.limit(steps[2]) == 5


def test_the_cpu_check_never_installs_and_the_gpu_check_installs_first(tmp_path):
    cpu = [s for p in all_parts(Mode(True, False, tmp_path, tmp_path)) for s in p.steps]
    gpu = [s for p in all_parts(Mode(False, False, tmp_path, tmp_path)) for s in p.steps]
    assert not any("--install" in s.argv for s in cpu)
    assert "--install" in gpu[0].argv and not gpu[0].budgeted and all(s.budgeted for s in gpu[1:])
    assert sum(s.floor_s for s in gpu if s.budgeted) <= 480 and sum(s.floor_s for s in cpu) <= 180
    assert all(dict(s.env).get("TRITON_INTERPRET") != "1" for s in gpu)
    with pytest.raises(SystemExit):
        gpu_env.main(["--install", "--device", "cpu", "--out", str(tmp_path / "x.json")])


def test_a_run_clears_what_an_earlier_one_wrote_and_nothing_else(tmp_path):
    from moemesh.tools.bench.gpu_check import clear

    (tmp_path / "engine.json").write_text('{"verdict": "pass"}')
    (tmp_path / "mesh-logs").mkdir()
    (tmp_path / "mesh-logs" / "trace.jsonl").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    clear(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_install_plan_from_the_project_files():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert gpu_env.install_plan(pyproject, {"version": "2.13.0+cu128", "cuda": "12.8"}, ROOT) == []
    missing = gpu_env.install_plan(pyproject, None, ROOT)
    torch_req = next(r for r in pyproject["project"]["dependencies"] if r.startswith("torch"))
    assert missing[0] == ["install", torch_req] and missing[1][:3] == ["install", "-e", f"{ROOT}[kernels]"]
    assert {gpu_env.requirement_name(r) for r in missing[1][3:]} == set(gpu_env.CHECK_PACKAGES)
    cpu_build = gpu_env.install_plan(pyproject, {"version": "2.13.0+cpu", "cuda": None}, ROOT)
    assert cpu_build[0] == ["uninstall", "-y", "torch"] and cpu_build[1:] == missing


def test_env_verdict_wants_cuda_on_a_gpu_run():
    info = {"torch": "2.13.0+cpu", "cuda": None, "triton": "3.9.0", "device": "cuda", "cuda_available": False}
    assert gpu_env.verdict(info, None)[0] == "fail"
    assert gpu_env.verdict(info | {"device": "cpu"}, None)[0] == "pass"


def test_pytest_log_is_read_by_dtype():
    log = "\n".join([
        "tests/kernels/test_rmsnorm.py::test_matches_reference[cuda-fp32-shape0-False] PASSED [  1%]",
        "tests/kernels/test_rmsnorm.py::test_matches_reference[cuda-bf16-shape0-False] FAILED [  2%]",
        "tests/kernels/test_rmsnorm.py::test_matches_reference[cuda-bf16-shape1-False] PASSED [  3%]",
        "tests/kernels/test_kv_pack.py::test_gather[cuda] SKIPPED (needs a CUDA device) [  4%]",
        "FAILED tests/kernels/test_rmsnorm.py::test_matches_reference[cuda-bf16-shape0-False] - AssertionError",
    ])
    doc = read_pytest_log(log)
    assert doc["by_dtype"] == {"bf16": {"failed": 1, "passed": 1}, "fp32": {"passed": 1}, "other": {"skipped": 1}}
    assert doc["failed"] == ["tests/kernels/test_rmsnorm.py::test_matches_reference[cuda-bf16-shape0-False]"]


UCX_LOG = """\
2026-12-04 22:02:31,810 INFO moemesh.shared.transport.ucx: UCX on devices lo, transports ^cma
[1796421755.053397] [vm:10023:0]   +--------------------------------+----------------------------------------------+
[1796421755.053413] [vm:10023:0]   | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory |
[1796421755.053414] [vm:10023:0]   +--------------------------------+--------------------------------------------+-------------+
[1796421755.053414] [vm:10023:0]   |                          0..92 | eager short                                | sysv/memory |
[1796421755.053416] [vm:10023:0]   |                        8K..inf | (?) rendezvous fragmented copy-in copy-out | tcp/lo |
[1796421755.053467] [vm:10023:0]   | ucp_context_0 inter-node cfg#1 | tagged message by ucp_tag_send* from cuda memory |
[1796421755.053469] [vm:10023:0]   |                        0..inf | rendezvous zero-copy read from remote | cuda_ipc/cuda, cuda_copy/cuda |
"""


def test_ucx_protocol_tables_are_read_from_a_worker_log():
    assert mesh_gpu.ucx_protocols(UCX_LOG) == [
        {"scope": "intra-node", "op": "tagged message by ucp_tag_send*", "memory": "host",
         "transports": ["sysv/memory", "tcp/lo"]},
        {"scope": "inter-node", "op": "tagged message by ucp_tag_send*", "memory": "cuda",
         "transports": ["cuda_ipc/cuda", "cuda_copy/cuda"]},
    ]


def test_engine_agreement_and_the_bf16_judgement():
    a = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]
    b = [[1, 2, 3], [4, 0, 6], [7, 8, 9], [2, 1, 1]]
    got = engine_gpu.agreement(a, b)
    assert got == {"equal": 2, "of": 4, "first_diffs": [{"prompt": 1, "first_diff_at": 1},
                                                         {"prompt": 3, "first_diff_at": 0}]}
    hf = {"equal": 3, "of": 4, "first_diffs": []}
    assert engine_gpu.bf16_verdict(got, hf, 0.1, judged=True)["pass"] is False  # 50% against 75%
    assert engine_gpu.bf16_verdict(got, hf, 0.25, judged=True)["pass"] is True
    assert engine_gpu.bf16_verdict(got, hf, 0.1, judged=False)["pass"] is None
    assert engine_gpu.bf16_verdict(got, None, 0.1, judged=True)["pass"] is None
    # the part's verdict names what failed, with transformers' top-2 gap where fp32 parted
    models = {"tiny": {"fp32_equal_to_cpu": False, "fp32": {"equal": 3, "of": 4, "first_diffs": [
                  {"prompt": 1, "first_diff_at": 2, "top2_gap": 0.0012}]},
                       "bf16": engine_gpu.bf16_verdict(got, hf, 0.25, judged=True),
                       "sampled": {**got, "spec_tokens": 1, "lengths_ok": True}},
              "v4-tiny": {"error": "RuntimeError: CUDA error"}}
    verdict, reason, summary = engine_gpu.verdict(models)
    assert verdict == "fail" and "v4-tiny: RuntimeError" in reason and "differs from the CPU on 1 prompts" in reason
    assert "top-2 gap there: 0.0012" in reason and "bf16" not in reason and "sampled" not in reason
    assert "sampled = CPU on 2/4 (not judged)" in summary  # sampled answers may part at a near-tie
    models["tiny"]["sampled"]["lengths_ok"] = False
    assert "tiny: a sampled answer came back short" in engine_gpu.verdict(models)[1]


def test_prompts_spread_over_the_oracle_lengths():
    assert [len(p) for p in engine_gpu.prompt_set(100, 4, 0)] == [1, 8, 21, 64]
    many = engine_gpu.prompt_set(100, 32, 0)
    assert sorted({len(p) for p in many}) == sorted(set(engine_gpu.hf_oracle.PROMPT_LENS))
    assert all(p[0] == 0 and all(4 <= t < 100 for t in p[1:]) for p in many)


def test_quick_is_for_cpu_runs_only(tmp_path):
    from moemesh.tools.bench import gpu_check

    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--quick", "--out", str(tmp_path)])
    assert e.value.code == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA device")
def test_bench_launches_on_cuda_without_a_device_says_so(tiny_model, tmp_path):
    from tests.cli_in_process import moemesh

    res = moemesh("bench", "launches", "--model", tiny_model, "--device", "cuda", "--out", tmp_path / "l.json")
    assert res.returncode == 2 and "no CUDA device" in res.stderr
