"""API keys for the gateway: `Authorization: Bearer KEY`, checked before any route runs.

A pure ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would wrap
`receive` and hide client disconnects from the non-streaming path. Keys and the
presented header never reach a log line, an error message or a span.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

# Liveness and readiness probes carry no key (load balancers, compose healthchecks).
OPEN_PATHS = frozenset({"/health", "/health/ready"})


class ApiKeyError(ValueError):
    pass


def load_api_keys(keys: Iterable[str], keys_file: str = "") -> tuple[bytes, ...]:
    """The accepted keys: those given inline plus one per line of keys_file.

    Args:
        keys: inline keys (the `api_keys` setting); blanks are ignored.
        keys_file: a file with one key per line; blank lines and `#` comments are ignored.
    Returns:
        The keys as bytes, in a stable order; empty means authentication is off.
    Raises:
        ApiKeyError: the file is unreadable or holds no key. A file that was asked for
        but is empty must not silently leave the API open.
    """
    out = [k.strip() for k in keys if k.strip()]
    if keys_file:
        try:
            lines = Path(keys_file).read_text().splitlines()
        except OSError as e:
            raise ApiKeyError(f"api_keys_file {keys_file}: {e.strerror}") from None
        found = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not found:
            raise ApiKeyError(f"api_keys_file {keys_file} holds no key")
        out += found
    return tuple(dict.fromkeys(k.encode() for k in out))


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    """Compares against every key, with no early exit, so the time taken does not tell
    which key (or how much of one) matched."""
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(presented, k)
    return ok


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()


_MISSING = _error("You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                  "(i.e. Authorization: Bearer YOUR_KEY).")
_WRONG = _error("Incorrect API key provided.")  # never echoes the key, unlike OpenAI's own message


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[bytes, ...]):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        if token is not None and key_matches(token, self.keys):
            await self.app(scope, receive, send)
            return
        body = _MISSING if token is None else _WRONG
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="moemesh"')]})
        await send({"type": "http.response.body", "body": body})
