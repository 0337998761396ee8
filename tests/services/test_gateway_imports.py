import subprocess
import sys
from pathlib import Path

# What `python -m moemesh.services.gateway` loads before it serves, and every other module of
# the gateway, found in its folders: a module moved into a sub-package is still checked.
_DIR = Path(__file__).resolve().parents[2] / "services" / "gateway"
_GATEWAY = ("moemesh.services.gateway.__main__", "moemesh.services.gateway.service", "moemesh.services.gateway.http.app",
            *sorted("moemesh.services.gateway." + ".".join(p.relative_to(_DIR).with_suffix("").parts)
                    for p in _DIR.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")))


def test_the_check_sees_the_whole_gateway():
    assert {"moemesh.services.gateway.mesh.client", "moemesh.services.gateway.streaming.choices"} <= set(_GATEWAY)


def test_the_gateway_loads_neither_torch_nor_the_engine():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in _GATEWAY)
            + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
              "'moemesh.shared.engine', 'moemesh.shared.model.deepseek', 'moemesh.shared.kernels'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_protocol_loads_neither_torch_nor_the_engine():
    code = ("import sys, moemesh.shared.protocol.messages, moemesh.shared.protocol.prefix_hash, "
            "moemesh.shared.config.common\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('moemesh.shared.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
