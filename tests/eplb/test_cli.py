import json
import subprocess

from moemesh.shared.eplb.placement import Placement
from moemesh.shared.eplb.workloads import Workload
from tests.cli_in_process import moemesh

SMALL = Workload(num_layers=3, num_experts=32, tokens_per_window=4096)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return moemesh("eplb", *args)


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


def test_place_ours_hierarchical_keeps_groups_on_nodes(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps({"loads": SMALL.windows(1)[0].tolist()}))
    r = _cli("place", "--loads", str(tmp_path / "l.json"), "--ranks", "4", "--redundant", "1",
             "--algorithm", "ours-hierarchical", "--nodes", "2", "--groups", "4", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["algorithm"] == "ours-hierarchical"
    for layer in doc["layers"]:
        node_groups = [{e // 8 for rank in layer[n * 2:(n + 1) * 2] for e in rank} for n in range(2)]
        assert len(node_groups[0]) == len(node_groups[1]) == 2 and not node_groups[0] & node_groups[1]


def test_compare_grid_prints_and_saves_the_comparison(tmp_path):
    out = tmp_path / "grid.json"
    r = _cli("compare", "--grid", "--skews", "zipf:1.2", "--experts", "64", "--layers", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["summary"]["scenarios"] == 12 and len(doc["rows"]) == 12
    assert set(doc["timing_ms"]) == {f"{kind} K={k}" for kind in ("zipf", "hot") for k in (0, 1, 2)}
    assert "12 scenarios" in r.stdout and "zipf:1.2 | 64 | 32 | 2 |" in r.stdout
    r = _cli("compare", "--grid", "--skews", "pareto:2", "--out", str(out))
    assert r.returncode == 2 and "unknown skew" in r.stderr
