"""What every `moemesh bench ...` command shares: list arguments and the saved results."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def save(result: dict, out: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}", file=sys.stderr)
