"""An incremental decoder for chunked bodies (RFC 9112 section 7.1).

A streamed completion is hundreds of small chunks. Parsing each through h11
costs an event, a state-machine step and two generator hops; this decoder
costs a find and a slice. It is as strict as h11 on the framing (hex sizes,
CRLF line ends, bounded size lines and trailers), so a backend that breaks the
framing is caught, never relayed as if it were data. Chunk extensions and
trailers are dropped: framing is hop-by-hop, and the proxy frames its own.
"""

from __future__ import annotations

import re

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
MAX_LINE = 4096  # a chunk-size line with its extensions
MAX_TRAILERS = 64 * 1024

_SIZE, _DATA, _DATA_END, _TRAILERS = range(4)


class ChunkedError(ValueError):
    """The body's chunked framing is broken."""


class ChunkedDecoder:
    __slots__ = ("_buffer", "_state", "_remaining", "_trailer_bytes", "done")

    def __init__(self) -> None:
        self._buffer = b""
        self._state = _SIZE
        self._remaining = 0
        self._trailer_bytes = 0
        self.done = False

    @property
    def leftover(self) -> bytes:
        """Bytes after the last chunk: none, from a backend that keeps to HTTP/1.1."""
        return self._buffer if self.done else b""

    def feed(self, data: bytes) -> list[bytes]:
        """The body data carried by ``data`` (and what was left over before it)."""
        buffer = self._buffer + data if self._buffer else data
        size = len(buffer)
        pos = 0
        out: list[bytes] = []
        state = self._state
        while pos < size:
            if state == _DATA:
                take = min(self._remaining, size - pos)
                out.append(buffer[pos:pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                state = _DATA_END
            elif state == _SIZE:
                end = buffer.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > MAX_LINE:
                        raise ChunkedError("chunk size line too long")
                    break
                line = buffer[pos:end]
                semicolon = line.find(b";")
                digits = (line if semicolon < 0 else line[:semicolon]).rstrip(b" \t")
                if not _HEX.fullmatch(digits):
                    raise ChunkedError(f"bad chunk size {digits[:20]!r}")
                pos = end + 2
                self._remaining = int(digits, 16)
                state = _DATA if self._remaining else _TRAILERS
            elif state == _DATA_END:
                if size - pos < 2:
                    break
                if buffer[pos:pos + 2] != b"\r\n":
                    raise ChunkedError("chunk data not followed by CRLF")
                pos += 2
                state = _SIZE
            else:  # trailer lines, up to the empty line that ends the body
                end = buffer.find(b"\r\n", pos)
                if end < 0:
                    if self._trailer_bytes + size - pos > MAX_TRAILERS:
                        raise ChunkedError("trailers too long")
                    break
                self._trailer_bytes += end + 2 - pos
                if self._trailer_bytes > MAX_TRAILERS:
                    raise ChunkedError("trailers too long")
                if end == pos:
                    pos += 2
                    self.done = True
                    break
                pos = end + 2
        self._state = state
        self._buffer = buffer[pos:]
        return out
