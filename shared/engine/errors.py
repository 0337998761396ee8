"""What the engine raises at a request it cannot take, apart from the engine so that the
hand-off code and the services can name them without importing it."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot take (too long, duplicate id, ...)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NoCapacity(RuntimeError):
    """Not enough free KV blocks right now; the caller may retry later."""
