"""NATS plumbing shared by the services: connect, typed subscriptions, typed requests.

A subscription handler receives an already-validated message object. A payload that
does not validate is logged and, when the sender asked for a reply, answered with an
ErrorReply; the handler never sees it and the service keeps serving. A message whose
body claims another sender than its subject names (messages.py, `sender_matches`) is
dropped the same way.

Replies come back on the connection's own inbox prefix (ServiceConfig.inbox_prefix),
which its NATS user alone may subscribe to: nobody else reads its replies.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import msgpack
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from moemesh.shared.config.common import ServiceConfig
from moemesh.shared.protocol.messages import ErrorReply, ProtocolError, decode, encode, from_plain, sender_matches
from moemesh.shared.telemetry.tracing import extract_context

log = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[Any, Msg, Any], Awaitable[Any]]
Spawn = Callable[[Coroutine, str], asyncio.Task]


class RemoteError(RuntimeError):
    """The peer answered with an ErrorReply."""

    def __init__(self, reply: ErrorReply):
        super().__init__(f"{reply.code}: {reply.error}")
        self.reply = reply


def redact_url(urls: str) -> str:
    """NATS URLs as they may be shown: without a user:password@ part."""
    return ",".join(_strip_userinfo(u) for u in urls.split(","))


def _strip_userinfo(url: str) -> str:
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        scheme, rest = "", url.strip()
    host = rest.rsplit("@", 1)[-1]
    return f"{scheme}{sep}{host}"


class NatsUnreachable(ConnectionError):
    """The first connection to NATS did not succeed in time."""


class Unreachable(RuntimeError):
    """Nobody answered: no responders, or the request timed out."""


class NoResponders(Unreachable):
    """Nothing is subscribed to the subject: whoever served it is gone (a process that
    dies has its connection, and so its subscriptions, dropped by the server at once)."""


class LinkEvents:
    """Who wants to know when the connection to NATS goes down and comes back: while it is
    down, silence from peers says nothing about them (heartbeat registries hold their
    verdicts), and what was published meanwhile may be lost (gateways ask for it again)."""

    def __init__(self):
        self.down: list[Callable[[], None]] = []
        self.up: list[Callable[[], None]] = []

    def _fire(self, fns: list[Callable[[], None]]) -> None:
        for fn in fns:
            try:
                fn()
            except Exception:
                log.exception("NATS link listener failed")


async def connect(cfg: ServiceConfig, name: str, link: LinkEvents | None = None) -> NATS:
    async def on_error(e: Exception) -> None:
        log.warning("NATS error: %s", e)

    conn: list[NATS] = []

    async def on_disconnect() -> None:
        if conn and (conn[0].is_closed or conn[0].is_draining):
            return  # our own close, not an outage
        log.warning("NATS disconnected; reconnecting")
        if link is not None:
            link._fire(link.down)

    async def on_reconnect() -> None:
        log.info("NATS reconnected")
        if link is not None:
            link._fire(link.up)

    # The servers in the order given (dont_randomize): a service of a cluster lists its own
    # host's node first, and the others are its fallbacks, not its peers' load to share.
    kw: dict[str, Any] = dict(
        servers=[u.strip() for u in cfg.nats_url.split(",") if u.strip()], dont_randomize=True,
        name=name, connect_timeout=5, reconnect_time_wait=0.5,
        max_reconnect_attempts=-1, allow_reconnect=True, error_cb=on_error,
        disconnected_cb=on_disconnect, reconnected_cb=on_reconnect, ping_interval=5,
        inbox_prefix=cfg.inbox_prefix,
    )
    if cfg.nats_user:
        kw.update(user=cfg.nats_user, password=cfg.nats_password)
    if cfg.nats_creds:
        kw["user_credentials"] = cfg.nats_creds
    # nats-py retries a first connection for ever (max_reconnect_attempts=-1): bound it.
    try:
        nc = await asyncio.wait_for(nats.connect(**kw), cfg.nats_connect_timeout_s)
        conn.append(nc)
        return nc
    except asyncio.TimeoutError:
        raise NatsUnreachable(f"cannot reach NATS at {redact_url(cfg.nats_url)} (no connection within "
                              f"{cfg.nats_connect_timeout_s:g}s)") from None


async def disconnect(nc: NATS) -> None:
    """Drain (in-flight handlers finish, pending publishes go out), or close when that fails.
    With the server gone (reconnecting), closing flushes into a dead socket and raises:
    the connection is over either way, and a service stopping then must still exit cleanly."""
    try:
        await nc.drain()
        return
    except Exception as e:
        log.info("NATS drain failed (%s); closing", type(e).__name__)
    try:
        await nc.close()
    except Exception as e:
        log.warning("NATS connection closed uncleanly: %s", e)


async def subscribe(nc: NATS, subject: str, cls: type, handler: Handler, queue: str = "",
                    spawn: Spawn | None = None):
    """Subscribe with validation. handler(obj, msg, trace_context) may return a reply
    message object, which is sent when the sender asked for one.

    NATS hands a subscription's messages to its callback one at a time. With `spawn`
    (a TaskSet's spawn) each handler runs in a task of its own, for handlers that wait on
    something else (a transfer) and must not hold up the next message; the owner of the
    tasks cancels those still running when it closes."""

    async def cb(msg: Msg) -> None:
        try:
            obj = decode(msg.data, cls)
        except ProtocolError as e:
            log.warning("rejected message on %s: %s", msg.subject, e)
            await _respond(msg, ErrorReply(str(e), "bad_request"))
            return
        if not sender_matches(obj, msg.subject):
            log.warning("dropped a %s on %s: its body names another sender", cls.__name__, msg.subject)
            return
        try:
            reply = await handler(obj, msg, extract_context(msg.headers))
        except Exception as e:  # a handler bug must not take the subscription down
            log.exception("handler for %s failed", msg.subject)
            await _respond(msg, ErrorReply(f"{type(e).__name__}: {e}", "internal"))
            return
        if reply is not None:
            await _respond(msg, reply)

    if spawn is None:
        return await nc.subscribe(subject, queue=queue, cb=cb)

    async def in_task(msg: Msg) -> None:
        spawn(cb(msg), f"on {msg.subject}")

    return await nc.subscribe(subject, queue=queue, cb=in_task)


async def _respond(msg: Msg, obj: Any) -> None:
    if not msg.reply:
        return
    try:
        await msg.respond(encode(obj))
    except Exception as e:  # connection lost while replying; the requester times out
        log.warning("could not reply on %s: %s", msg.subject, e)


async def request(nc: NATS, subject: str, obj: Any, reply_cls: type[T], timeout: float,
                  headers: dict | None = None) -> T:
    try:
        msg = await nc.request(subject, encode(obj), timeout=timeout, headers=headers)
    except NoRespondersError:
        raise NoResponders(f"no responders on {subject}") from None
    except (NatsTimeout, asyncio.TimeoutError):
        raise Unreachable(f"no reply on {subject} within {timeout:.1f}s") from None
    try:
        raw = msgpack.unpackb(msg.data, raw=False)
    except Exception:
        raise ProtocolError(f"reply on {subject} is not valid MessagePack") from None
    if isinstance(raw, dict) and "code" in raw and "error" in raw and reply_cls is not ErrorReply:
        raise RemoteError(from_plain(raw, ErrorReply))
    return from_plain(raw, reply_cls)


async def publish(nc: NATS, subject: str, obj: Any, headers: dict | None = None) -> None:
    await nc.publish(subject, encode(obj), headers=headers)
