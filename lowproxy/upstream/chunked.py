"""An incremental decoder for chunked bodies (RFC 9112 section 7.1).

A streamed completion is hundreds of small chunks. Parsing each through h11
costs an event, a state-machine step and two generator hops; this decoder
costs a find and a slice. It is as strict as h11 on the framing (hex sizes,
CRLF line ends, bounded size lines and trailers), so a backend that breaks the
framing is caught, never relayed as if it were data. Chunk extensions and
trailers are dropped: framing is hop-by-hop, and the proxy frames its own.

ChunkedRelay runs the decoder inside a connection's data_received callback,
so that a streamed token costs no task wake-up.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Protocol

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_HEX_DIGITS = b"0123456789abcdefABCDEF"
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
        if self._state == _SIZE and not self._buffer:
            # A streamed token is one read holding exactly one whole chunk with a
            # plain size line: checked as strictly as below, in one step (a size
            # of 1 to 16 hex digits is what _HEX takes; strip is its cheaper test,
            # partition cheaper than find with bounds and two slices).
            digits, crlf, rest = data.partition(b"\r\n")
            if crlf and 0 < len(digits) <= 16 and not digits.strip(_HEX_DIGITS):
                size = int(digits, 16)
                if size and len(rest) == size + 2 and rest[-2:] == b"\r\n":
                    return [rest[:-2]]
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
                if end - pos > MAX_LINE:  # the same bound whether it came in one read or more
                    raise ChunkedError("chunk size line too long")
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


class RelayedStream(Protocol):
    """What ChunkedRelay needs of the connection it is attached to."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def pause_reading(self) -> None: ...


# Gets the body pieces one network read brought; answers whether its consumer is slow.
Deliver = Callable[[list[bytes]], bool]


class Waiting:
    """A connection's sink a coroutine waits on until it is done, slow, or failed
    (ChunkedRelay here, the head reader and the length-framed relay of cycle.py)."""

    __slots__ = ("stream", "_waiter")
    _waiter: asyncio.Future[None] | None
    stream: RelayedStream

    def wait(self) -> asyncio.Future[None]:
        """A future that _wake() sets; the caller awaits it.

        A future, not a coroutine awaiting one: no coroutine made per wait (one
        per leg for the head, more for a relay that waits) and no frame held by
        a stream that waits for minutes. A waiter cancelled with its task is
        left done, and _wake() skips it.
        """
        waiter = self._waiter = self.stream.loop.create_future()
        return waiter

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


class ChunkedRelay(Waiting):
    """Decodes a chunked body in a connection's callbacks and delivers it.

    The connection calls data_received and connection_closed; a coroutine
    waits in wait() until the body is done, the consumer is slow (reading is
    then paused) or something failed. Errors (ChunkedError for broken framing
    or a hang-up before the last chunk; whatever deliver raised, ClientGone
    among them) are kept for that coroutine to raise.
    """

    __slots__ = ("deliver", "decoder", "error", "slow", "stray")

    def __init__(self, stream: RelayedStream, deliver: Deliver) -> None:
        self.stream = stream
        self.deliver = deliver
        self.decoder = ChunkedDecoder()
        self.error: BaseException | None = None
        self.slow = False
        self.stray = False  # bytes arrived after the body ended
        self._waiter: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        return self.decoder.done

    def data_received(self, data: bytes) -> None:
        if self.error is not None:
            return
        if self.decoder.done:
            self.stray = True
            return
        try:
            pieces = self.decoder.feed(data)
            if pieces and self.deliver(pieces):
                self.slow = True
                self.stream.pause_reading()
        except BaseException as exc:  # raised again by the waiting coroutine
            self.error = exc
        if self.error is not None or self.slow or self.decoder.done:
            self._wake()

    def connection_closed(self, exc: BaseException | None) -> None:
        if self.error is None and not self.decoder.done:
            detail = f": {exc}" if exc else ""
            self.error = ChunkedError(f"connection closed mid-body{detail}")
        self._wake()

