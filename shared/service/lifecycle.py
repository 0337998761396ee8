"""`main()` for every service: uvloop, signals, an exit stack, and a clean drain.

SIGTERM or SIGINT sets a stop event; the service's `drain()` then runs (stop taking
new work, finish what is in flight, bounded by its drain timeout) and its context
manager closes. A second signal skips the drain. A signal while the service is still
starting (connecting to NATS, loading a model) cancels the start: it exits in any state.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from contextlib import AsyncExitStack
from typing import Any, Callable


def configure_logging(level: str) -> None:
    """The service's own level wins: `moemesh <service>` has set up logging already, and
    basicConfig alone would keep that level."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level.upper())
    for noisy in ("nats", "ucx", "ucxx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


async def serve(make_service: Callable[[], Any], drain_timeout_s: float) -> None:
    stop = asyncio.Event()
    hits = 0

    def on_signal() -> None:
        nonlocal hits
        hits += 1
        stop.set()
        if hits > 1:
            logging.getLogger(__name__).warning("second signal: exiting without draining")
            raise SystemExit(1)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    async with AsyncExitStack() as stack:
        starting = asyncio.ensure_future(stack.enter_async_context(make_service()))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not starting.done():  # AsyncService.__aenter__ undoes what was started
            starting.cancel()
            try:
                await starting
            except asyncio.CancelledError:
                pass
            logging.getLogger(__name__).info("stopped while starting")
            return
        svc = starting.result()
        # What start-up built (a model, a tokenizer, the engine) lives as long as the process:
        # out of the collector's reach, a full collection no longer walks it. Such a walk
        # paused a serving loop for 40-60 ms every few hundred steps.
        gc.collect()
        gc.freeze()
        failed = asyncio.ensure_future(svc.failed())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if failed.done():
            # Nothing to drain: what it held has moved (its last beat said it is leaving).
            logging.getLogger(__name__).error("exiting: %s", failed.result())
            raise SystemExit(1)
        failed.cancel()
        logging.getLogger(__name__).info("stopping: draining in-flight work (up to %.0fs)", drain_timeout_s)
        try:
            await asyncio.wait_for(svc.drain(), drain_timeout_s)
        except asyncio.TimeoutError:
            logging.getLogger(__name__).warning("drain timed out; closing with work in flight")


def run(make_service: Callable[[], Any], drain_timeout_s: float) -> None:
    try:
        import uvloop

        uvloop.run(serve(make_service, drain_timeout_s))
    except ImportError:  # uvloop is a dependency; this only protects odd platforms
        asyncio.run(serve(make_service, drain_timeout_s))


class AsyncService:
    """The lifecycle every service shares: `async with Service(cfg) as svc:` starts it,
    and stops it on the way out, or at once if starting failed half-way (so a service
    that could not start leaves no connection or task behind). Subclasses define
    start(), drain() and stop(); stop() must be safe to call twice, and failed() where
    the service can break for good while running."""

    async def failed(self) -> str:
        """Returns (why) when the service can no longer serve and must exit; never by default."""
        await asyncio.Event().wait()
        return ""

    async def __aenter__(self):
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
