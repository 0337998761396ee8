"""A real nats-server on a free port, for services run in the test's own process."""

from __future__ import annotations

import pytest

from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    group = ProcessGroup(tmp_path_factory.mktemp("nats"))
    port = free_port()
    start_nats(group, port)
    yield f"nats://127.0.0.1:{port}"
    group.stop()
