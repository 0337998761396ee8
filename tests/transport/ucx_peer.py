"""The two sides of tests/transport/test_ucx_cut_network.py, each in its own process and
network namespace:

    python -m tests.transport.ucx_peer recv DEVICE DIR   # its address to DIR/addr; takes what arrives
    python -m tests.transport.ucx_peer send DEVICE DIR   # one send; DIR/ready; after DIR/cut, a send
                                                         # on a fresh endpoint; its outcome as JSON

Each waits at most 120 s for its counterpart."""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from moemesh.shared.transport.base import TransferError
from moemesh.shared.transport.ucx import UcxTransport


async def _until(path: Path) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never came")
        await asyncio.sleep(0.02)


async def main(role: str, device: str, d: Path) -> None:
    t = UcxTransport(device, "tcp")
    await t.start()
    if role == "recv":
        (d / "addr.tmp").write_bytes(t.address)
        os.rename(d / "addr.tmp", d / "addr")
        await asyncio.sleep(120)
        return
    await _until(d / "addr")
    peer = (d / "addr").read_bytes()
    buf = np.zeros(1 << 16, np.uint8)
    await t.send(peer, buf, 1, 10.0)  # reachable: the endpoint works
    (d / "ready").write_text("")
    await _until(d / "cut")
    t.forget(peer)  # the next send connects anew, to a host that is cut off
    lag = 0.0

    async def tick() -> None:
        nonlocal lag
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            lag = max(lag, time.perf_counter() - t0 - 0.01)

    ticker = asyncio.create_task(tick())
    t0 = time.perf_counter()
    error = ""
    try:
        await t.send(peer, buf, 2, 2.0)
    except TransferError as e:
        error = str(e)
    took = time.perf_counter() - t0
    await asyncio.sleep(0.05)  # the ticker sees a hold that ended with the send
    ticker.cancel()
    print(json.dumps({"took_s": took, "max_lag_s": lag, "error": error}), flush=True)
    os._exit(0)  # not a clean close: its endpoint's peer is unreachable


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
