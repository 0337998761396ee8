"""Installed import names live under one `moemesh` namespace, while the source tree keeps
the layout of the design card: `shared/` (libraries), `services/` (the five services) and
`tools/` (CLI, launcher, benchmarks, profiling) map to `moemesh.shared`,
`moemesh.services` and `moemesh.tools`. Everything else is in pyproject.toml.
"""
from setuptools import find_packages, setup

LAYERS = ("shared", "services", "tools")

setup(
    package_dir={f"moemesh.{layer}": layer for layer in LAYERS},
    packages=[f"moemesh.{p}" for p in find_packages(include=[f"{layer}*" for layer in LAYERS])],
)
