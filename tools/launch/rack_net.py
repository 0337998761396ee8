"""Three hosts on one machine: a network namespace each, wired to two networks.

- ctl: NATS, HTTP and the DEP ranks' host-side agreement (gloo); in a rack, the
  management network.
- data: UCX (KV hand-offs, expert weights); in a rack, the RDMA fabric.

Each network is a bridge in this (the root) namespace, and each host has one veth into
each bridge: `ctl0` and `data0` inside its namespace. The root namespace gets one ctl
address too, so that the bench (its load client, its stats requests) reaches the
gateways and NATS as any client on the management network would. Nothing is routed
anywhere else: the bridges have no uplink, the namespaces no default route.

Faults at host granularity need nothing but `ip`:
- cut a host's data plane: `data0` down inside its namespace (its NATS keeps working);
- cut a host off entirely: both links down;
- kill a host: every process it runs (the bench's ProcessGroup knows which).

Requires root (CAP_NET_ADMIN). The names carry a tag, so a bench that was killed before
it cleaned up leaves names the next run of the same tag removes first.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

CTL_DEV, DATA_DEV = "ctl0", "data0"
PLANES = ("ctl", "data")


class RackNetError(RuntimeError):
    pass


@dataclass(frozen=True)
class Host:
    name: str  # h1, h2, ...
    netns: str
    ctl_addr: str
    data_addr: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """Put before a command to run it on this host."""
        return ("ip", "netns", "exec", self.netns)


def plan_hosts(n: int, tag: str = "mm", subnet: int = 231) -> list[Host]:
    """Pure: host i (1-based) is .i+1 on 10.<subnet>.1.0/24 (ctl) and 10.<subnet>.2.0/24 (data);
    .1 of ctl is the root namespace's."""
    if not 1 <= n <= 200:
        raise ValueError("1 to 200 hosts")
    return [Host(f"h{i}", f"{tag}-rack-h{i}", f"10.{subnet}.1.{i + 1}", f"10.{subnet}.2.{i + 1}")
            for i in range(1, n + 1)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        raise RackNetError("no `ip` command (iproute2): the rack's hosts are network namespaces") from None
    if check and r.returncode != 0:
        raise RackNetError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}"
                           + (" (network namespaces need root)" if "ermission" in r.stderr else ""))
    return r


class RackNetwork:
    """The namespaces and bridges of a rack; a context manager that always removes them."""

    def __init__(self, n_hosts: int = 3, tag: str = "mm", subnet: int = 231):
        self.tag = tag
        self.hosts = plan_hosts(n_hosts, tag, subnet)
        self.subnet = subnet
        self.bridges = {p: f"{tag}-rack-{p}"[:15] for p in PLANES}
        self.root_ctl_addr = f"10.{subnet}.1.1"

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def __enter__(self) -> "RackNetwork":
        self.remove()  # what a killed run of the same tag left
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _build(self) -> None:
        for plane, br in self.bridges.items():
            _ip("link", "add", br, "type", "bridge")
            _ip("link", "set", br, "up")
        _ip("addr", "add", f"{self.root_ctl_addr}/24", "dev", self.bridges["ctl"])
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            _ip("-n", h.netns, "link", "set", "lo", "up")
            for plane, dev, addr in (("ctl", CTL_DEV, h.ctl_addr), ("data", DATA_DEV, h.data_addr)):
                outer = self._outer(h, plane)
                _ip("link", "add", outer, "type", "veth", "peer", "name", dev, "netns", h.netns)
                _ip("link", "set", outer, "master", self.bridges[plane], "up")
                _ip("-n", h.netns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", h.netns, "link", "set", dev, "up")

    def _outer(self, h: Host, plane: str) -> str:
        return f"{self.tag}-{h.name}{plane[0]}"[:15]  # the root side of a host's veth

    def remove(self) -> None:
        for h in self.hosts:
            # The kernel destroys a deleted namespace (and the veths in it) later, on its own
            # time; deleting the root sides now frees their names for the next rack at once.
            for plane in PLANES:
                _ip("link", "del", self._outer(h, plane), check=False)
            _ip("netns", "del", h.netns, check=False)
        for br in self.bridges.values():
            _ip("link", "del", br, check=False)

    # ---- faults ---------------------------------------------------------------------------
    def set_plane(self, host: str, plane: str, up: bool) -> None:
        """Take one network of a host down (its link inside the namespace) or bring it back."""
        if plane not in PLANES:
            raise ValueError(f"plane must be one of {PLANES}")
        _ip("-n", self.host(host).netns, "link", "set", CTL_DEV if plane == "ctl" else DATA_DEV,
            "up" if up else "down")
