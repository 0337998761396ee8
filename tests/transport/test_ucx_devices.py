"""Which network devices UCX may use, and so where it listens: the configured ones, the
environment's, or loopback only; never every interface of the host."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from moemesh.shared.transport.base import TransferState
from moemesh.shared.transport.ucx import DEFAULT_NET_DEVICES, cma_status, context_transports, ucx_options


def test_devices_are_always_named():
    nb = {"TCP_CONN_NB": "y"}
    assert ucx_options("", "", {}) == {"NET_DEVICES": DEFAULT_NET_DEVICES, **nb}  # UCX picks the transports
    assert ucx_options("", "", {"UCX_NET_DEVICES": "eth1", "UCX_TLS": "tcp"}) == {"NET_DEVICES": "eth1", **nb}
    assert ucx_options("mlx5_0:1", "rc,sm", {"UCX_NET_DEVICES": "eth1"}) == {"NET_DEVICES": "mlx5_0:1", "TLS": "rc,sm",
                                                                              **nb}
    assert "TCP_CONN_NB" not in ucx_options("", "", {"UCX_TCP_CONN_NB": "n"})  # the environment's choice stands


def _tcp_listeners() -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                out.add(cols[1].split(":")[0])
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


@pytest.mark.parametrize("devices", ["lo", ""])  # configured, and the default
def test_a_tcp_transport_listens_on_loopback_only_and_moves_bytes(devices, monkeypatch):
    pytest.importorskip("ucxx")
    from moemesh.shared.transport.ucx import UcxTransport

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)

    def check(a) -> None:
        assert a._ctx.config["NET_DEVICES"] == "lo" and a._ctx.config["TLS"] == "tcp"
        listening = _tcp_listeners()
        assert listening and listening <= LOOPBACK, listening

    _pair_moves_bytes(lambda: UcxTransport(devices, "tcp"), 1 << 20, check)


def _pair_moves_bytes(make, nbytes: int, check) -> None:
    """Two started transports from make(); check(first), then nbytes sent from the first
    arrive whole at the second."""
    async def go():
        a, b = make(), make()
        await a.start()
        await b.start()
        try:
            check(a)
            src = np.arange(nbytes, dtype=np.uint8)
            dst = np.zeros_like(src)
            tr = b.post_recv(dst, tag=7)
            await a.send(b.address, src, 7, timeout=10)
            await tr.wait(10)
            assert tr.state == TransferState.SUCCESS and np.array_equal(src, dst)
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


INFO = """#
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 1  flags -- tcp/lo
#      resource 2  :  md 2  dev 0  flags -- sysv/memory
#      resource 4  :  md 4  dev 0  flags -- cma/memory
#"""


def test_the_log_says_whether_transfers_on_one_host_take_one_copy_and_why_not():
    opened = context_transports(INFO)
    assert opened == ["self/memory", "tcp/lo", "sysv/memory", "cma/memory"]
    assert cma_status(opened, "", "1", "2") == ""  # open: nothing to explain
    without = [t for t in opened if not t.startswith("cma/")]
    assert "configured transports (tcp)" in cma_status(without, "tcp", None, "0")
    assert "ptrace_scope is 2" in cma_status(without, "", "2\n", "0")
    assert "seccomp" in cma_status(without, "", "0", "2")
    assert "UCX_LOG_LEVEL" in cma_status(without, "", None, "0")


def test_a_default_transport_on_this_host_moves_rendezvous_bytes_with_one_copy(monkeypatch):
    """Left to UCX, two processes' worth of transports on one host: CMA opens where Yama and
    seccomp allow it (this machine's do), and a rendezvous message arrives whole."""
    pytest.importorskip("ucxx")
    from moemesh.shared.transport.ucx import UcxTransport

    monkeypatch.delenv("UCX_TLS", raising=False)
    if cma_status([], "", *_host_limits()).startswith(("Yama", "a seccomp")):
        pytest.skip("this host forbids cross-process reads")

    def check(a) -> None:
        assert "cma/memory" in a.transports and a._ctx.config["TLS"] == "all"

    _pair_moves_bytes(UcxTransport, 4 << 20, check)


def _host_limits():
    from moemesh.shared.transport.ucx import _read

    return _read("/proc/sys/kernel/yama/ptrace_scope"), _read("/proc/self/status", "Seccomp")
