"""The count of files one streamed chat request passes (docs/architecture.md), taken by
running the request: the rules the count follows, and the count itself as a ceiling
that only goes down."""

import asyncio

from moemesh.tools.launch.nats_server import start_nats
from moemesh.tools.launch.procs import ProcessGroup, free_port
from moemesh.tools.profile import request_files as rf

# Lower it as files leave the path; it must never rise.
MAX_FILES = 25


def _code(path: str, name: str = "f"):
    return rf.func(compile(f"def {name}(): pass", str(rf.PROJECT / path), "exec").co_consts[0])


def test_the_count_drops_background_edges_and_keeps_first_reach_order():
    loop, app, hb, pub = (_code("shared/service/engine_loop.py"), _code("services/gateway/http/app.py"),
                          _code("shared/service/heartbeat.py"), _code("shared/service/nats_io.py", "publish"))
    init = _code("shared/kv/__init__.py")
    request = {(None, app): 0, (hb, pub): 1, (app, loop): 2, (app, init): 3, (loop, pub): 4}
    idle = {(hb, pub): 0}
    # nats_io counts: the loop publishes for the request, even though heartbeats publish the same way
    assert rf.request_files(request, idle) == ["services/gateway/http/app.py", "shared/service/engine_loop.py",
                                               "shared/service/nats_io.py"]


def test_one_streamed_chat_request_through_a_mesh(tiny_model, tmp_path):
    group = ProcessGroup(tmp_path)
    port = free_port()
    try:
        start_nats(group, port)
        result = asyncio.run(rf.measure(f"nats://127.0.0.1:{port}", tiny_model))
    finally:
        group.stop()
    files = result["files"]
    assert files[0].startswith("services/gateway/")
    for f in ("shared/engine/engine.py", "services/prefill/service.py", "services/decode/service.py",
              "shared/transport/ucx.py"):
        assert f in files
    assert not any(f.startswith(("shared/model/", "shared/kernels/")) for f in files), files
    assert not any(f.endswith("__init__.py") for f in files)
    assert result["num_files"] <= MAX_FILES, rf.report(result)
