"""What every benchmark records about where it ran, so figures can be compared."""

from __future__ import annotations

import os
import platform
import sys
import time
from importlib import metadata


def environment(device: str = "cpu") -> dict:
    import torch

    info = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "moemesh": package_version("moemesh"),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def package_version(pkg: str) -> str | None:
    """An installed distribution's version, None when it is not installed."""
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
