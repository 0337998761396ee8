"""Start-up never claims what is not true: a busy port, an unreachable NATS or a bad model
directory is one line naming the cause, a process still connecting exits on SIGTERM, and
every flag says what it does."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time

import pytest

from moemesh.shared.config.loader import ConfigFileError
from moemesh.tools.launch.settings import route_settings
from moemesh.tools.launch.up import Mesh, UpConfig


def moemesh(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "moemesh.tools.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_version_and_help_on_every_flag():
    from moemesh.tools.cli.main import build_parser

    r = moemesh("--version")
    assert r.returncode == 0 and r.stdout.startswith("moemesh ")
    missing = []

    def walk(p, path):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, [*path, name])
            elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)) and not a.help:
                missing.append(" ".join([*path, *(a.option_strings[:1] or [a.dest])]))

    walk(build_parser(), ["moemesh"])
    assert missing == []


def test_the_command_line_imports_neither_torch_nor_nats_to_parse():
    # Every command (moemesh up, --help, a bench) parses first: a subcommand that imports
    # its tool to list choices made each of them wait 3 s for torch on this machine.
    code = ("import sys; from moemesh.tools.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'nats', 'numpy', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_a_busy_port_fails_at_once_naming_it(tiny_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = moemesh("up", "--model", tiny_model, "--port", str(port))
    assert r.returncode == 1 and f"port {port}" in r.stderr and "Traceback" not in r.stderr
    assert "moemesh is up" not in r.stdout and "starting" not in r.stdout  # nothing was started
    assert time.monotonic() - t0 < 30


def test_a_bad_model_directory_is_one_line(tmp_path):
    r = moemesh("up", "--model", str(tmp_path / "nowhere"))
    assert r.returncode == 1 and "config.json: not found" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    r = moemesh("up", "--model", str(tmp_path / "m"))
    assert r.returncode == 1 and "not valid JSON" in r.stderr and "Traceback" not in r.stderr


def test_an_unreachable_nats_is_named(tiny_model):
    url = f"nats://someone:secret@127.0.0.1:{_closed_port()}"
    with pytest.raises(RuntimeError, match=r"cannot reach NATS at nats://127\.0\.0\.1:\d+ within") as e:
        Mesh(UpConfig(model=tiny_model, port=0, nats_url=url, nats_probe_s=0.5))
    assert "secret" not in str(e.value)
    # a service on its own: one line within its connect timeout, not a retry loop for ever
    r = subprocess.run([sys.executable, "-m", "moemesh.services.kv_store", "--nats-url", url,
                        "--set", "nats_connect_timeout_s=1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot reach NATS at nats://127.0.0.1:" in r.stderr
    assert "Traceback" not in r.stderr and "secret" not in r.stderr


def test_a_service_still_connecting_exits_on_sigterm():
    url = f"nats://127.0.0.1:{_closed_port()}"
    p = subprocess.Popen([sys.executable, "-m", "moemesh.services.kv_store", "--nats-url", url,
                          "--set", "nats_connect_timeout_s=600"], stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stderr:  # it is trying: each failed attempt is a warning
            if "NATS error" in line:
                break
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        p.wait()
        p.stderr.close()


def test_set_reaches_every_service_that_has_the_field():
    sets = route_settings(["max_num_seqs=32", "log_level=DEBUG", "gateway.max_inflight=64", "decode.engine=mock"])
    assert sets["prefill"] == ("max_num_seqs=32", "log_level=DEBUG")
    assert sets["decode"] == ("max_num_seqs=32", "log_level=DEBUG", "engine=mock")
    assert sets["gateway"] == ("log_level=DEBUG", "max_inflight=64")
    assert sets["kv_store"] == sets["balancer"] == ("log_level=DEBUG",)
    for bad, needle in (("nope=1", "no service has"), ("gateway.max_num_seqs=3", "gateway has no setting"),
                        ("x.y=1", "no role 'x'"), ("novalue", "FIELD=VALUE")):
        with pytest.raises(ConfigFileError, match=needle):
            route_settings([bad])
    r = moemesh("up", "--set", "nope=1")
    assert r.returncode == 2 and "no service has a setting 'nope'" in r.stderr
