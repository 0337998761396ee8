"""Server-sent events as the HTML standard defines them, parsed without I/O.

Lines end at CRLF, LF or CR, and only there: text decoders that also break at U+2028,
U+0085 and the like would split a JSON payload that holds one, and count a stream error
that never happened. An event is the `data` lines before a blank line, joined with LF; a
`data:` value loses one leading space; comment lines (`:`) and other fields are skipped;
an event without data is not dispatched.
"""

from __future__ import annotations

_BOM = "\ufeff"


class SSEParser:
    """feed() bytes in any split; it returns the data of each event that completed."""

    __slots__ = ("_buf", "_data", "_started", "_cr")

    def __init__(self) -> None:
        self._buf = b""  # an unfinished line
        self._data: list[str] = []  # data lines of the event being read
        self._started = False  # past a leading byte-order mark
        self._cr = False  # the last chunk ended in CR: an LF first in the next belongs to it

    def feed(self, chunk: bytes) -> list[str]:
        if self._cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._cr = chunk[-1:] == b"\r"
        buf = self._buf + chunk if self._buf else chunk
        out: list[str] = []
        start, n = 0, len(buf)
        while start < n:
            lf, cr = buf.find(b"\n", start), buf.find(b"\r", start)
            if lf < 0 and cr < 0:
                break
            end = lf if cr < 0 or (0 <= lf < cr) else cr
            nxt = end + 2 if buf[end:end + 2] == b"\r\n" else end + 1
            self._line(buf[start:end].decode("utf-8", "replace"), out)
            start = nxt
        self._buf = buf[start:]
        return out

    def close(self) -> list[str]:
        """The stream ended: an unterminated last event is dropped, as the standard says."""
        self._buf, self._data = b"", []
        return []

    def _line(self, line: str, out: list[str]) -> None:
        if not self._started:
            self._started = True
            if line.startswith(_BOM):
                line = line[1:]
        if not line:
            if self._data:
                out.append("\n".join(self._data))
                self._data = []
            return
        if line[0] == ":":
            return
        name, colon, value = line.partition(":")
        if name != "data":
            return
        if colon and value.startswith(" "):
            value = value[1:]
        self._data.append(value)
