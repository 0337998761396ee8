"""The GPU check of decode graphs runs end to end on a CPU (--smoke: the static path
uncaptured), so that a GPU session spends its time on the GPU, not on this script."""

import json

from moemesh.tools.bench import graphs_gpu


def test_smoke(tmp_path):
    out = tmp_path / "graphs.json"
    assert graphs_gpu.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    ex = doc["sections"]["exactness-float32"]["result"]
    assert ex["graph_equals_eager"] and ex["tokens_equal_to_dynamic"] == ex["requests"]
    assert [r["batch"] for r in doc["sections"]["host-time"]["result"]["off"]] == [1, 4]
