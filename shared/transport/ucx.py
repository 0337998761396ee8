"""UCX data plane on ucxx's core API, driven by the worker's event file descriptor.

- Each transport owns a UCX context and worker, so several can live in one process
  (tests run a sender and a receiver side by side).
- Endpoints are made from worker addresses that peers exchange over NATS, never
  through a listener, with error handling off: with it on, UCX leaves shared memory
  for TCP (20-40x slower).
- Progress runs on the worker's epoll fd, registered with the event loop; a wake-up
  progresses the worker, takes arrivals, completes requests and re-arms the worker.
  Only while UCX reports more work at once (arm() is busy: bytes are moving) does the
  drive run again, after the other ready callbacks; an idle or waiting transport costs
  nothing. One bounded exception: a send progresses the worker for up to
  `send_spin_us` before it sleeps (`_spin_sends`), since its answer usually comes
  sooner than the wake-up that would deliver it. A receiver never spins.
- Receives land in staging memory allocated once (see staging.py).
- What listens: UCX's TCP transport opens one listening socket per network device it
  may use (peers connect to the worker address's TCP entries there). So the devices are
  always named (`ucx_options`): the configured ones, UCX_NET_DEVICES from the
  environment, or else loopback only. A mesh across hosts names its data network's
  device; nothing listens on an interface nobody chose.

A receive is not posted up front. Each drive probes for whatever message has arrived,
under any tag, and receives it (tag_probe + recv_with_handle): into the buffer of the
receive waiting for that tag, or, when none waits, into memory of its own that a later
post_recv takes over (or that is dropped after its receiver gave up). So a receive that
times out leaves nothing behind in UCX that could later write into memory already
handed to someone else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from moemesh.shared.transport.base import Transfer, TransferError

log = logging.getLogger(__name__)

# A message that arrives before its receive is posted waits this long, within this
# many bytes in all; a receive that gave up has its late message dropped for this long.
_EARLY_KEEP_S = 30.0
_EARLY_MAX_BYTES = 256 << 20
_FORGET_S = 60.0
_JANITOR_S = 1.0
# While requests are in flight, the worker is also progressed this often. The event fd
# is the mechanism; this only bounds the cost of a wake-up UCX failed to signal, and
# counts them (`missed_wakeups`) so that such a loss shows rather than slows.
_WATCHDOG_S = 0.25


@dataclass
class _Recv:
    buf: object
    nbytes: int
    fut: asyncio.Future


@dataclass
class _Send:
    req: object
    fut: asyncio.Future
    buf: object  # held until the send completes


@dataclass
class _Inflight:
    tag: int
    req: object  # the UCX request receiving the message
    recv: _Recv | None  # the receive it lands in; None: it lands in `sink`
    sink: np.ndarray | None = None


# UCX's NET_DEVICES when neither the config nor the environment names any: shared memory
# still works between processes of a host, and no network interface gets a listener.
DEFAULT_NET_DEVICES = "lo"

# How long a send progresses UCX before it waits on the event fd (`_spin_sends`). A
# 1 MiB send on shared memory ends within it; a 64 KiB one sooner.
DEFAULT_SEND_SPIN_US = 400.0
# Worker addresses of the transports started in this process. A send to one of them is
# answered by this same thread only once the spin gives the loop back, so it never spins.
_IN_THIS_PROCESS: set[bytes] = set()


def ucx_options(net_devices: str, tls: str, environ) -> dict[str, str]:
    """The UCX context options of a transport.

    Args:
        net_devices: the configured devices ("" for none), e.g. "mlx5_0:1" or "eth1".
        tls: the configured transports ("" for none).
        environ: the process environment; UCX reads UCX_* from it too, and options given
            here override those.
    Returns:
        NET_DEVICES, always (see DEFAULT_NET_DEVICES), and TLS when one is chosen.
    """
    options = {"NET_DEVICES": net_devices or environ.get("UCX_NET_DEVICES") or DEFAULT_NET_DEVICES}
    # No TLS of our own by default: between processes of one host UCX then moves a
    # rendezvous message with one copy (CMA: the receiver reads the sender's buffer) where
    # the kernel allows it, and otherwise through shared memory (see cma_status). The
    # shared-memory path copies into and out of a bounded ring, so both processes must run
    # while the bytes move: on a host whose cores are busy, as a serving host's are, it
    # fell to 1-5 GB/s where CMA kept 7-10 (bench kv-transfer beside one busy core).
    if tls:
        options["TLS"] = tls
    if "UCX_TCP_CONN_NB" not in environ:
        # UCX's TCP transport connects a new endpoint with a blocking connect() by default:
        # to a peer whose host is unreachable (a cut data network) that held the caller's
        # event loop for 40-130 s, so the worker missed its heartbeats and was taken for dead.
        options["TCP_CONN_NB"] = "y"
    return options


def context_transports(info: str) -> list[str]:
    """The transports a UCX context opened ("sysv/memory", "cma/memory", "tcp/lo", ...),
    from its printed info."""
    out = []
    for line in info.splitlines():
        if "resource" in line and "--" in line:
            out.append(line.rsplit("--", 1)[1].split()[0])
    return out


def cma_status(transports: list[str], tls: str, ptrace_scope: str | None, seccomp: str | None) -> str:
    """Why UCX moves rendezvous messages on this host with one copy or without: "" when
    CMA is open, else the reason, for the log.

    Args:
        transports: context_transports of the context.
        tls: the TLS the context was given ("" for UCX's choice).
        ptrace_scope: /proc/sys/kernel/yama/ptrace_scope's text, None when absent (no Yama).
        seccomp: the Seccomp field of /proc/self/status ("0" off, "2" a filter), None if unknown.
    """
    if any(t.startswith("cma/") for t in transports):
        return ""
    if tls:
        return f"the configured transports ({tls}) leave it out"
    if ptrace_scope is not None and ptrace_scope.strip() not in ("0", "1"):
        return (f"Yama's ptrace_scope is {ptrace_scope.strip()}: processes may not read one another's memory "
                "(kernel.yama.ptrace_scope=0 or 1 allows it)")
    if seccomp is not None and seccomp.strip() == "2":
        return ("a seccomp filter is on and UCX's own test of process_vm_writev failed (a container runtime's "
                "default profile allows it with CAP_SYS_PTRACE)")
    return "UCX did not open it on this host (UCX_LOG_LEVEL=debug says why)"


def _read(path: str, field: str = "") -> str | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    if not field:
        return text
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


class UcxTransport:
    def __init__(self, net_devices: str = "", tls: str = "", send_spin_us: float = DEFAULT_SEND_SPIN_US):
        self._net_devices = net_devices
        self._tls = tls
        self._send_spin_s = send_spin_us * 1e-6
        self._spinning = False
        self._eps: dict[bytes, object] = {}
        self.address = b""
        self._api = None  # ucxx._lib.libucxx
        self._ctx = None
        self._worker = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._again = False  # a drive is scheduled with call_soon
        self._abandoned: dict[int, float] = {}  # tag -> monotonic time its receiver gave up
        self._pending: dict[int, _Recv] = {}  # posted, nothing arrived yet
        self._inflight: list[_Inflight] = []  # arrived, bytes landing
        self._early: dict[int, tuple[np.ndarray, float]] = {}  # arrived before its receive
        self._early_bytes = 0
        self._sending: list[_Send] = []
        self._janitor: asyncio.TimerHandle | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self.transports: list[str] = []  # what the UCX context opened, once started
        self.num_drives = 0  # wake-ups and re-runs, for tests and profiles
        self.missed_wakeups = 0

    async def start(self) -> None:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx._lib.libucxx as api

        options = ucx_options(self._net_devices, self._tls, os.environ)
        self._api = api
        self._ctx = api.UCXContext(options, feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
        self.transports = context_transports(self._ctx.info)
        why = cma_status(self.transports, options.get("TLS") or os.environ.get("UCX_TLS", ""),
                         _read("/proc/sys/kernel/yama/ptrace_scope"), _read("/proc/self/status", "Seccomp"))
        log.info("UCX on devices %s: %s; one-copy transfers on this host: %s", options["NET_DEVICES"],
                 ", ".join(self.transports), "yes (cma)" if not why else f"no, {why}")
        self._worker = api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self.address = bytes(self._worker.address.tobytes())
        _IN_THIS_PROCESS.add(self.address)
        self._loop = asyncio.get_running_loop()
        self._fd = self._worker.epoll_file_descriptor
        self._loop.add_reader(self._fd, self._drive)
        self._drive()

    async def close(self) -> None:
        if self._loop is not None and self._fd >= 0:
            self._loop.remove_reader(self._fd)
            self._fd = -1
        for h in (self._janitor, self._watchdog):
            if h is not None:
                h.cancel()
        self._janitor = self._watchdog = None
        self._fail_all(TransferError("transport closed"))
        eps, self._eps = self._eps, {}
        for ep in eps.values():
            _abort(ep)
        self._worker = self._ctx = None
        _IN_THIS_PROCESS.discard(self.address)

    def _endpoint(self, peer: bytes):
        ep = self._eps.get(peer)
        if ep is None:
            api = self._api
            ep = api.UCXEndpoint.create_from_worker_address(
                self._worker, api.UCXAddress.create_from_buffer(peer), False)
            self._eps[peer] = ep
        return ep

    def forget(self, peer: bytes) -> None:
        """Drop a cached endpoint (the peer restarted or died)."""
        ep = self._eps.pop(peer, None)
        if ep is not None:
            _abort(ep)

    # ---- progress ----------------------------------------------------------------------
    def _drive(self) -> None:
        """Progress the worker and settle what finished, then arm it for the next event."""
        self._again = False
        w = self._worker
        if w is None or self._fd < 0:
            return
        self.num_drives += 1
        try:
            w.progress()
            if self._take_arrivals():  # start their reads now, not a wake-up later
                w.progress()
            self._complete_sends()
            self._complete_receives()
            armed = w.arm()
        except Exception as e:  # fail every waiting transfer at once rather than let each time out
            log.exception("UCX progress failed")
            self._fail_all(TransferError(f"UCX progress failed: {type(e).__name__}: {e}"))
            return
        if not armed:  # UCX has work right now: run again once the loop has served the rest
            self._again = True
            self._loop.call_soon(self._drive)
        self._arm_watchdog()

    def _spin_sends(self) -> None:
        """Progress the worker for at most send_spin_s while sends are outstanding, then
        hand the wait to the event fd. A large send ends when the receiver has read it
        and answered; by then this process is usually asleep, and waking it costs about
        as long as reading 1 MiB on this host. Bounded, on the sending side only (which
        would otherwise wait), and one at a time: a receiver never spins."""
        self._spinning = False
        w = self._worker
        if w is None or self._fd < 0:
            return
        deadline = time.perf_counter() + self._send_spin_s
        while self._sending and time.perf_counter() < deadline:
            w.progress()
            os.sched_yield()  # the receiver may have been woken onto this core
            if any(s.req.completed for s in self._sending):
                self._complete_sends()
        self._drive()

    def _busy(self) -> bool:
        return bool(self._sending or self._pending or self._inflight)

    def _arm_watchdog(self) -> None:
        if self._watchdog is None and self._loop is not None and self._busy():
            self._watchdog = self._loop.call_later(_WATCHDOG_S, self._on_watchdog)

    def _on_watchdog(self) -> None:
        self._watchdog = None
        if self._again or self._fd < 0:
            return
        before = (len(self._sending), len(self._pending), len(self._inflight))
        self._drive()
        if (len(self._sending), len(self._pending), len(self._inflight)) != before:
            self.missed_wakeups += 1
            log.debug("UCX progress found work without a wake-up (%d so far)", self.missed_wakeups)

    def _fail_all(self, err: TransferError) -> None:
        waiting = [r.fut for r in self._pending.values()] + [i.recv.fut for i in self._inflight if i.recv is not None]
        waiting += [s.fut for s in self._sending]
        self._pending.clear()
        self._inflight.clear()
        self._sending.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(err)

    def _take_arrivals(self) -> bool:
        from ucxx._lib.arr import Array

        api = self._api
        took = False
        while True:
            probe = self._worker.tag_probe(api.UCXXTag(0), api.UCXXTagMask(0), remove=True)  # any tag
            if not probe.matched:
                return took
            took = True
            tag = probe.sender_tag.value
            r = self._pending.pop(tag, None)
            if r is not None and probe.length == r.nbytes:
                item = _Inflight(tag, None, r)
                item.req = self._worker.tag_recv_with_handle(Array(r.buf), probe)
            else:
                # No receive for it (yet, or any more), or one of another size: take the
                # bytes anyway, so the sender completes and UCX frees what it buffered.
                item = _Inflight(tag, None, r, np.empty(probe.length, np.uint8))
                item.req = self._worker.tag_recv_with_handle(Array(item.sink), probe)
            self._inflight.append(item)

    def _complete_sends(self) -> None:
        if not self._sending or not any(s.req.completed for s in self._sending):
            return
        done = [s for s in self._sending if s.req.completed]
        self._sending = [s for s in self._sending if not s.req.completed]
        for s in done:
            if s.fut.done():  # its sender timed out
                continue
            try:
                s.req.check_error()
            except Exception as e:
                s.fut.set_exception(e)
            else:
                s.fut.set_result(None)

    def _complete_receives(self) -> None:
        if not self._inflight:
            return
        done, still = [], []
        for i in self._inflight:
            (done if i.req.completed else still).append(i)
        if not done:
            return
        self._inflight = still
        for item in done:
            self._land(item)

    def _land(self, item: _Inflight) -> None:
        try:
            item.req.check_error()
            err = None
        except Exception as e:
            err = TransferError(f"UCX receive under tag {item.tag:#x} failed: {e}")
        r = item.recv
        if r is None and err is None and item.tag in self._pending:
            # Its receive was posted while the bytes were landing in a sink of their own.
            r = self._pending.pop(item.tag)
            if item.sink.nbytes == r.nbytes:
                _copy_into(r.buf, item.sink)
                item.sink = None
        if r is not None:
            if err is None and item.sink is not None:
                err = TransferError(f"expected {r.nbytes} bytes under tag {item.tag:#x}, "
                                    f"{item.sink.nbytes} arrived")
            if r.fut.done():
                pass
            elif err is not None:
                r.fut.set_exception(err)
            else:
                r.fut.set_result(None)
        elif err is not None:
            log.warning("%s", err)
        elif self._abandoned.pop(item.tag, None) is not None:
            log.info("discarding %d bytes that arrived after their receive timed out", item.sink.nbytes)
        elif self._early_bytes + item.sink.nbytes > _EARLY_MAX_BYTES:
            log.warning("dropping %d bytes under tag %#x: no receive posted for them and %d bytes "
                        "already wait for theirs", item.sink.nbytes, item.tag, self._early_bytes)
        else:
            self._early[item.tag] = (item.sink, time.monotonic())
            self._early_bytes += item.sink.nbytes
            self._arm_janitor()

    def _arm_janitor(self) -> None:
        if self._janitor is None and (self._abandoned or self._early) and self._loop is not None:
            self._janitor = self._loop.call_later(_JANITOR_S, self._on_janitor)

    def _on_janitor(self) -> None:
        """Forget abandoned tags and unclaimed early arrivals after a while."""
        self._janitor = None
        now = time.monotonic()
        for tag, since in list(self._abandoned.items()):
            if now - since > _FORGET_S:
                del self._abandoned[tag]
        for tag, (data, since) in list(self._early.items()):
            if now - since > _EARLY_KEEP_S:
                log.warning("dropping %d bytes under tag %#x: no receive was posted for them", data.nbytes, tag)
                del self._early[tag]
                self._early_bytes -= data.nbytes
        self._arm_janitor()

    # ---- receiving ------------------------------------------------------------------
    def post_recv(self, buf, tag: int) -> Transfer:
        nbytes = _nbytes(buf)
        fut = asyncio.get_running_loop().create_future()
        self._abandoned.pop(tag, None)
        early = self._early.pop(tag, None)
        if early is not None:
            data = early[0]
            self._early_bytes -= data.nbytes
            if data.nbytes != nbytes:
                fut.set_exception(TransferError(f"expected {nbytes} bytes under tag {tag:#x}, {data.nbytes} arrived"))
            else:
                _copy_into(buf, data)
                fut.set_result(None)
            return Transfer(fut, nbytes, lambda: True)
        r = _Recv(buf, nbytes, fut)
        self._pending[tag] = r
        self._arm_watchdog()

        def try_cancel() -> bool:
            if self._pending.get(tag) is not r:  # its bytes are landing or have landed
                return fut.done()
            del self._pending[tag]
            fut.cancel()
            self._abandoned[tag] = time.monotonic()
            self._arm_janitor()
            return True

        return Transfer(fut, nbytes, try_cancel, landing=lambda: self._pending.get(tag) is not r)

    # ---- sending --------------------------------------------------------------------
    async def send(self, peer: bytes, buf, tag: int, timeout: float) -> None:
        from ucxx._lib.arr import Array

        if self._worker is None:
            raise TransferError("UCX transport is not started")
        try:
            # asyncio.timeout, not wait_for: wait_for wraps the send in a task of its own,
            # which costs more than a 1 MiB transfer on shared memory.
            async with asyncio.timeout(timeout):
                ep = self._endpoint(peer)
                item = _Send(ep.tag_send(Array(buf), self._api.UCXXTag(tag)), self._loop.create_future(), buf)
                self._sending.append(item)
                self._drive()  # an eager send completes here; a large one starts its handshake
                if (not item.fut.done() and self._send_spin_s > 0 and not self._spinning
                        and peer not in _IN_THIS_PROCESS):
                    self._spinning = True  # after the sends ready to go out with it are posted
                    self._loop.call_soon(self._spin_sends)
                await item.fut
        except TimeoutError:
            self.forget(peer)
            raise TransferError(f"UCX send of {_nbytes(buf)} bytes timed out after {timeout:.1f}s") from None
        except TransferError:
            self.forget(peer)
            raise
        except Exception as e:
            self.forget(peer)
            raise TransferError(f"UCX send failed: {type(e).__name__}: {e}") from None


def _abort(ep) -> None:
    """Start closing an endpoint and let it go. Never close_blocking: it progresses only
    this worker until the peer answers the flush, so a dead peer, or one that is served
    by this same thread, would hold the event loop forever."""
    try:
        ep.close()
    except Exception:  # a peer that died leaves an endpoint that cannot close cleanly
        pass


def _copy_into(buf, data: np.ndarray) -> None:
    if hasattr(buf, "copy_"):  # a torch tensor, possibly on the GPU
        import torch

        buf.view(-1).view(torch.uint8).copy_(torch.from_numpy(data))
    else:
        memoryview(buf).cast("B")[:] = memoryview(data)


def _nbytes(buf) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else len(memoryview(buf).cast("B"))
