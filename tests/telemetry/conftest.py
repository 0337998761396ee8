"""Keeps the runner's OTEL_* settings out: a stray collector endpoint would make tests send spans."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
