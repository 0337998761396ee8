"""The tiny model `moemesh up` makes on first use: whole, even with two launchers at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moemesh.shared.model.config import ModelConfig
from moemesh.tools.launch.up import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_two_launchers_at_once_get_one_whole_tiny_model(tmp_path):
    code = "import sys; from pathlib import Path; from moemesh.tools.launch.up import ensure_tiny_model; " \
           "print(ensure_tiny_model(Path(sys.argv[1])))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    want = tmp_path / "models" / "tiny"
    assert [Path(out.strip()) for out, _ in outs] == [want, want]
    assert ModelConfig.from_dir(str(want)).num_hidden_layers > 0
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny"]  # no half-made copy left
    assert ensure_tiny_model(tmp_path) == want  # made once: later launchers take it as it is
