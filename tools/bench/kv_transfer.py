"""`moemesh bench kv-transfer`: UCX throughput between two processes, beside the
machine's own memory-copy bandwidth for the same sizes.

The receiver runs in a child process and publishes its UCX worker address over NATS,
as a decode worker does. Both sides use staging memory allocated once. For each size
the sender sends `iters` messages, one after another (one request's pull at a time)
and then all at once (many requests' pulls in flight); the receiver answers with one
small message when all have landed, so the figure includes the whole transfer. The
ceiling is the machine's copy bandwidth: a single-threaded memcpy of 256 MiB.

That one memcpy can take a path no transfer takes. glibc copies with non-temporal stores
(past the cache) from `x86_non_temporal_threshold` up, 192 MiB on this project's
development machines: there a 256 MiB memcpy ran at 12-16 GB/s while copies of 1-160 MiB
ran at 8-9. A transfer's copy (the kernel's, on the single-copy path) makes ordinary
stores. So the bench also copies the same 256 MiB in 1 MiB pieces, which stream through
memory as the one memcpy does but store as a transfer does, and reports the ratios
against that too.

With `context_lens`, the sizes are those of one request's hand-off at each context
length, for DeepSeek-V4-Flash's hybrid cache and for V3's latent cache, computed from
the layouts (`kv_bytes.handoff_sizes`), and the result also gives each request's
transfer time.
"""

from __future__ import annotations

import asyncio
import glob
import multiprocessing as mp
import subprocess
import time
from dataclasses import asdict, dataclass

import numpy as np

from moemesh.tools.bench.env import environment, percentile

_ACK_TAG = 1 << 62


@dataclass(frozen=True)
class KVBenchConfig:
    sizes: tuple[int, ...] = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
    iters: int = 20
    repeats: int = 3
    nats_url: str = ""  # empty: start a nats-server for the run
    tls: str = ""
    context_lens: tuple[int, ...] = ()  # per-request sizes at these contexts instead of `sizes`
    send_spin_us: float = -1.0  # < 0: the transport's default, as the workers run it

    def __post_init__(self):
        if self.context_lens:
            from moemesh.tools.bench.kv_bytes import handoff_sizes

            object.__setattr__(self, "sizes", tuple(sorted({r["bytes"] for r in handoff_sizes(self.context_lens)})))


def copy_bandwidth(nbytes: int, min_seconds: float = 0.2, piece: int = 0) -> float:
    """Bytes/s of a single-threaded memcpy between two buffers touched beforehand: the
    ceiling a transfer between two processes on this host is measured against. piece > 0:
    the same bytes copied in pieces of that size, one memcpy each. A small buffer is copied
    again and again within one timing, at least 4 MiB in all, so that the clock and the
    call count little beside the copy.

    Both buffers start on a page, as staging slots do. Two buffers the heap placed a few
    bytes apart modulo 4 KiB copied 64 KiB at 2.3-2.8 GB/s on this project's AMD machines
    against 25-33 GB/s otherwise: glibc's `rep movsb` path, which it takes there for mid
    sizes, is slow at such a short distance."""
    src, dst = _page_aligned(nbytes), _page_aligned(nbytes)
    src.fill(1)
    dst.fill(0)
    step = piece if 0 < piece < nbytes else nbytes
    spans = [(o, min(o + step, nbytes)) for o in range(0, nbytes, step)] * max(1, (4 << 20) // nbytes)
    moved = sum(b - a for a, b in spans)
    rates = []
    end = time.perf_counter() + min_seconds
    while time.perf_counter() < end or len(rates) < 5:
        t = time.perf_counter()
        for a, b in spans:
            np.copyto(dst[a:b], src[a:b])
        rates.append(moved / (time.perf_counter() - t))
    return percentile(rates, 50)


def _page_aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 4096, np.uint8)
    off = -raw.ctypes.data % 4096
    return raw[off : off + nbytes]


def parse_non_temporal_threshold(tunables: str) -> int | None:
    """glibc's x86_non_temporal_threshold from `ld.so --list-tunables`' output. Pure."""
    for line in tunables.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "glibc.cpu.x86_non_temporal_threshold":
            try:
                return int(rest.split()[0], 0)
            except (IndexError, ValueError):
                return None
    return None


def non_temporal_threshold() -> int | None:
    """The size from which this process's memcpy stores past the cache; None where glibc
    does not say (another libc, another architecture, a glibc before 2.33)."""
    for ld in sorted(glob.glob("/lib64/ld-linux*.so*") + glob.glob("/lib/*/ld-linux*.so*")):
        try:
            out = subprocess.run([ld, "--list-tunables"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found = parse_non_temporal_threshold(out)
        if found is not None:
            return found
    return None


def ceiling_piece(threshold: int | None) -> int:
    """The piece size of the ordinary-store ceiling: 1 MiB, or half the threshold where
    that is smaller, so that no piece crosses it."""
    return min(1 << 20, threshold // 2) if threshold else 1 << 20


def _receiver(nats_url: str, sizes, iters, repeats, tls: str, spin: float) -> None:
    asyncio.run(_receive(nats_url, sizes, iters, repeats, tls, spin))


def _transport(tls: str, spin: float):
    from moemesh.shared.transport.ucx import UcxTransport

    return UcxTransport(tls=tls) if spin < 0 else UcxTransport(tls=tls, send_spin_us=spin)


async def _receive(nats_url, sizes, iters, repeats, tls, spin) -> None:
    import nats

    from moemesh.shared.transport.staging import StagingPool

    t = _transport(tls, spin)
    await t.start()
    pool = StagingPool(sum(sizes) + (1 << 20))  # a slot a size, all at once
    nc = await nats.connect(nats_url)
    sender = asyncio.get_running_loop().create_future()

    async def on_hello(msg):
        if not sender.done():
            sender.set_result(msg.data)

    await nc.subscribe("bench.kv.hello", cb=on_hello)
    while not sender.done():
        await nc.publish("bench.kv.addr", t.address)
        await asyncio.sleep(0.1)
    peer = sender.result()
    ack = pool.alloc(8)
    slots = [pool.alloc(size) for size in sizes]
    rounds = [slot for slot in slots for _ in range(2 * repeats)]
    # A round's receives are posted before the previous round is acknowledged, so the
    # sender never sends into receives not yet there (its messages would pile up as
    # early arrivals, which are bounded).
    def post(k: int) -> list:  # round k's receives, under the tags the sender gives that round
        return [t.post_recv(rounds[k].buffer(), k * iters + i) for i in range(iters)]

    transfers = post(0)
    for k in range(len(rounds)):
        for tr in transfers:
            await tr.wait(60)
        transfers = post(k + 1) if k + 1 < len(rounds) else []
        await t.send(peer, ack.buffer(), _ACK_TAG + (k + 1) * iters, 30)
    await nc.close()
    await t.close()


async def _send(cfg: KVBenchConfig, nats_url: str) -> list[dict]:
    import nats

    from moemesh.shared.transport.staging import StagingPool

    t = _transport(cfg.tls, cfg.send_spin_us)
    await t.start()
    nc = await nats.connect(nats_url)
    addr = asyncio.get_running_loop().create_future()

    async def on_addr(msg):
        if not addr.done():
            addr.set_result(msg.data)

    await nc.subscribe("bench.kv.addr", cb=on_addr)
    peer = await asyncio.wait_for(addr, 60)
    await nc.publish("bench.kv.hello", t.address)
    pool = StagingPool(max(cfg.sizes) + (1 << 20))
    ack = pool.alloc(8)
    rows = []
    tag = 0
    for size in cfg.sizes:
        slot = pool.alloc(size)
        slot.tensor.fill_(7)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for r in range(2 * cfg.repeats):
            concurrent = bool(r % 2)  # one pull at a time, then many requests' pulls in flight together
            got = t.post_recv(ack.buffer(), _ACK_TAG + tag + cfg.iters)
            start = time.perf_counter()
            if concurrent:
                await asyncio.gather(*(t.send(peer, slot.buffer(), tag + i, 30) for i in range(cfg.iters)))
            else:
                for i in range(cfg.iters):
                    await t.send(peer, slot.buffer(), tag + i, 30)
            await got.wait(60)
            rates[concurrent].append(size * cfg.iters / (time.perf_counter() - start))
            tag += cfg.iters
        pool.free(slot)
        rows.append({"bytes": size, "ucx_one_GBps": percentile(rates[False], 50) / 1e9,
                     "ucx_concurrent_GBps": percentile(rates[True], 50) / 1e9,
                     "memcpy_same_size_GBps": copy_bandwidth(size) / 1e9})
    await nc.close()
    await t.close()
    return rows


def run(cfg: KVBenchConfig) -> dict:
    from moemesh.tools.launch.nats_server import start_nats
    from moemesh.tools.launch.procs import ProcessGroup, free_port

    group = ProcessGroup()
    nats_url = cfg.nats_url
    try:
        if not nats_url:
            port = free_port()
            start_nats(group, port)
            nats_url = f"nats://127.0.0.1:{port}"
        ctx = mp.get_context("spawn")
        child = ctx.Process(target=_receiver, args=(nats_url, cfg.sizes, cfg.iters, cfg.repeats, cfg.tls,
                                                          cfg.send_spin_us),
                            daemon=True)
        child.start()
        try:
            rows = asyncio.run(_send(cfg, nats_url))
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
    finally:
        group.stop()
    ceiling = copy_bandwidth(256 << 20, 1.0) / 1e9
    threshold = non_temporal_threshold()
    piece = ceiling_piece(threshold)
    pieces = copy_bandwidth(256 << 20, 1.0, piece) / 1e9
    for r in rows:
        r["ratio_one"] = r["ucx_one_GBps"] / ceiling
        r["ratio_concurrent"] = r["ucx_concurrent_GBps"] / ceiling
    big = [r for r in rows if r["bytes"] >= 1 << 20]

    def worst(key: str, by: float) -> float | None:
        return min((r[key] / by for r in big), default=None)

    extra = {"per_request": per_request(cfg.context_lens, rows)} if cfg.context_lens else {}
    return {**extra, "bench": "kv-transfer", "config": asdict(cfg), "env": environment(), "results": rows,
            "machine_copy_GBps": ceiling, "goal_ratio": 0.70,
            "min_ratio_at_1MiB_plus": {"one": worst("ucx_one_GBps", ceiling),
                                       "concurrent": worst("ucx_concurrent_GBps", ceiling)},
            "non_temporal_threshold": threshold, "pieces_bytes": piece, "machine_copy_pieces_GBps": pieces,
            "min_ratio_at_1MiB_plus_pieces": {"one": worst("ucx_one_GBps", pieces),
                                              "concurrent": worst("ucx_concurrent_GBps", pieces)}}


def per_request(context_lens: tuple[int, ...], rows: list[dict]) -> list[dict]:
    """Each cache's hand-off at each context: its bytes and how long moving it took."""
    from moemesh.tools.bench.kv_bytes import handoff_sizes

    by_size = {r["bytes"]: r for r in rows}
    out = []
    for h in handoff_sizes(context_lens):
        r = by_size[h["bytes"]]
        out.append({**h, "ms_one": h["bytes"] / r["ucx_one_GBps"] / 1e6,
                    "ms_concurrent": h["bytes"] / r["ucx_concurrent_GBps"] / 1e6})
    return out


def _size(b: int) -> str:
    return f"{b / 2**20:.1f} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def table(result: dict) -> str:
    lines = [f"machine copy bandwidth (256 MiB memcpy): {result['machine_copy_GBps']:.2f} GB/s",
             f"{'size':>8} {'one GB/s':>9} {'ratio':>6} {'concurrent':>11} {'ratio':>6} {'memcpy same size':>17}"]
    for r in result["results"]:
        lines.append(f"{_size(r['bytes']):>8} {r['ucx_one_GBps']:>9.2f} {r['ratio_one']:>6.2f} "
                     f"{r['ucx_concurrent_GBps']:>11.2f} {r['ratio_concurrent']:>6.2f} {r['memcpy_same_size_GBps']:>17.2f}")
    if "per_request" in result:
        lines.append(f"{'one request, context':<40} {'bytes':>12} {'ms one':>8} {'ms concurrent':>14}")
        for r in result["per_request"]:
            lines.append(f"{r['cache'] + ', ' + str(r['context_len']):<40} {_size(r['bytes']):>12} "
                         f"{r['ms_one']:>8.1f} {r['ms_concurrent']:>14.1f}")
    m = result["min_ratio_at_1MiB_plus"]
    if m["one"] is not None:  # None: every size was under 1 MiB, where the goal does not apply
        lines.append(f"goal: >= {result['goal_ratio']:.0%} of machine copy bandwidth from 1 MiB up; worst measured "
                     f"{m['one']:.0%} one at a time, {m['concurrent']:.0%} concurrent")
    worst = result.get("min_ratio_at_1MiB_plus_pieces")
    if worst and worst["one"] is not None:
        t = result.get("non_temporal_threshold")
        where = f"glibc stores past the cache from {_size(t)} here" if t else "glibc's threshold unknown here"
        lines.append(f"the same 256 MiB in {_size(result['pieces_bytes'])} pieces, with the stores a transfer makes "
                     f"({where}): {result['machine_copy_pieces_GBps']:.2f} GB/s; against it the worst from 1 MiB up "
                     f"is {worst['one']:.0%} one at a time, {worst['concurrent']:.0%} concurrent")
    return "\n".join(lines)
