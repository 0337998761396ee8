"""The wire format the load client reads, parsed without I/O: an HTTP/1.1 chunked body
(RFC 9112 §7.1) that carries server-sent events.

Events are counted, not decoded: an event ends at a blank line, and the servers measured
here end every event with `\n\n` and put no raw newline inside one (its data is JSON).
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"


class ProtocolError(Exception):
    """The reply is not well-formed HTTP/1.1 chunked framing."""


class ChunkedSSE:
    """Incremental parser of a chunked HTTP body that carries server-sent events.

    feed() the bytes after the head as they arrive, in any split. `events` counts complete
    events (`...\\n\\n`) in the de-chunked body; `done` is set by the last (zero) chunk and
    its trailers; `complete` also needs the body to end in `data: [DONE]`.
    """

    __slots__ = ("events", "done", "_buf", "_left", "_state", "_tail")
    _SIZE, _DATA, _CRLF, _TRAILER = range(4)

    def __init__(self) -> None:
        self.events = 0
        self.done = False
        self._buf = b""  # bytes not consumed yet: an incomplete size line or CRLF
        self._left = 0  # bytes still to come of the current chunk
        self._state = self._SIZE
        self._tail = b""  # the body's last bytes: an event can end across a chunk boundary

    @property
    def complete(self) -> bool:
        return self.done and self._tail.endswith(DONE)

    def feed(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        while pos < end and not self.done:
            if self._state == self._DATA:
                stop = pos + min(self._left, end - pos)
                self.events += buf.count(b"\n\n", pos, stop)
                tail = self._tail
                if buf[pos] == 10 and tail.endswith(b"\n") and not tail.endswith(b"\n\n"):
                    self.events += 1  # "...\n" | "\n..."
                self._tail = (tail + buf[max(pos, stop - len(DONE)):stop])[-len(DONE):]
                self._left -= stop - pos
                pos = stop
                if not self._left:
                    self._state = self._CRLF
            elif self._state == self._CRLF:
                if end - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                pos += 2
                self._state = self._SIZE
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > 1024:
                        raise ProtocolError("chunk size line too long")
                    break
                line, pos = buf[pos:eol], eol + 2
                if self._state == self._TRAILER:
                    self.done = not line  # an empty line ends the trailers
                    continue
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line[:32]!r}") from None
                self._state, self._left = (self._DATA, size) if size else (self._TRAILER, 0)
        self._buf = buf[pos:] if pos < end else b""
