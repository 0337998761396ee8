import json
import subprocess
import sys

from moemesh.shared.eplb.placement import Placement
from moemesh.shared.eplb.workloads import Workload

SMALL = Workload(num_layers=3, num_experts=32, tokens_per_window=4096)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moemesh.tools.cli.main", "eplb", *args],
                          capture_output=True, text=True, timeout=120)


def test_place_score_and_incremental_round_trip(tmp_path):
    w = SMALL.windows(2)
    for i in range(2):
        (tmp_path / f"l{i}.json").write_text(json.dumps({"loads": w[i].tolist()}))
    r = _cli("place", "--loads", str(tmp_path / "l0.json"), "--ranks", "4", "--redundant", "1",
             "--out", str(tmp_path / "p0.json"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "p0.json").read_text())
    assert doc["algorithm"] == "ours" and doc["compute_ms"] >= 0
    assert len(doc["layers"]) == 3 and all(len(rank) == 9 for layer in doc["layers"] for rank in layer)
    placement = Placement.from_json(doc)

    r = _cli("score", "--placement", str(tmp_path / "p0.json"), "--loads", str(tmp_path / "l1.json"))
    assert r.returncode == 0, r.stderr
    score = json.loads(r.stdout)
    assert abs(score["instance_ratio"] - placement.instance_ratio(w[1].double())) < 1e-12
    assert len(score["layer_ratios"]) == 3

    r = _cli("place", "--loads", str(tmp_path / "l1.json"), "--ranks", "4", "--redundant", "1",
             "--algorithm", "deepseek-hierarchical", "--nodes", "2", "--current", str(tmp_path / "p0.json"),
             "--out", str(tmp_path / "p1.json"))
    assert r.returncode == 0, r.stderr
    doc1 = json.loads((tmp_path / "p1.json").read_text())
    moved = (Placement.from_json(doc1).phy2log != placement.phy2log).sum(1)
    assert doc1["moves_per_layer"] == moved.tolist() and doc1["total_moves"] == int(moved.sum())


def test_bad_input_is_a_clean_error(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps({"loads": [[1, 2, 3]]}))
    r = _cli("place", "--loads", str(tmp_path / "l.json"), "--ranks", "2", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "error" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "p.json").exists()
