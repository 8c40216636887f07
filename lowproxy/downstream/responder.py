"""The write half of one client exchange: framing, buffering, back-pressure.

A Responder answers one request over a small ``Wire`` (the client connection,
connection.py): h11 state for framing, raw writes, a drain that waits while
the client is slow. It never touches the socket or the server itself.
"""

from __future__ import annotations

from typing import Any, Protocol

import h11

from .._types import Headers
from ..answers import REASONS, json_body
from ..h11_internals import informational, response, send_data, send_end, send_response
from .messages import ClientGone

# Past this much unsent to a client, stop relaying until it catches up.
WRITE_HIGH_WATER = 64 * 1024


class Wire(Protocol):
    """What a Responder needs of its connection."""

    h11: h11.Connection
    transport: Any  # asyncio.Transport: written to directly by relay, the per-event path

    @property
    def draining(self) -> bool: ...

    @property
    def gone(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def write_buffer_size(self) -> int: ...

    def drop(self) -> None: ...


class Responder:
    """How a handler answers: start (status, headers), write chunks, end.

    A ``content_length`` passed to ``start`` is kept and enforced (h11),
    otherwise the body is chunked (HTTP/1.1) or close-delimited (HTTP/1.0).
    Bytes are written in as few syscalls as the handler allows: ``buffer``
    only collects, ``flush`` writes what was collected, ``write`` and ``end``
    flush and wait while the client is slow.
    """

    __slots__ = ("_wire", "started", "ended", "status", "bytes_out", "_head", "_chunked",
                 "_out", "_extra")

    def __init__(self, wire: Wire, head: bool) -> None:
        self._wire = wire
        self._head = head
        self.started = False
        self.ended = False
        self.status = 0
        self.bytes_out = 0
        self._chunked = False
        self._out: list[bytes] = []
        self._extra: Headers = []  # headers every final response carries (x-request-id)

    def add_header(self, name: bytes, value: bytes) -> None:
        """A header for the final response, unless that response already has one."""
        self._extra.append((name, value))

    def _with_extra(self, headers: Headers) -> Headers:
        for name, value in self._extra:
            if not any(key == name for key, _ in headers):
                headers.append((name, value))
        return headers

    async def start(self, status: int, headers: Headers,
                    content_length: int | None = None) -> None:
        """Begin the response; its head goes out with the first flush."""
        headers = self._with_extra(list(headers))
        # RFC 9110 section 8.6: never a Content-Length on a 204 (a backend's would
        # make a client that trusts it wait for bytes that never come).
        if content_length is not None and status != 204:
            headers.append((b"content-length", str(content_length).encode()))
        wire = self._wire
        if wire.draining:
            headers.append((b"connection", b"close"))
        self.started = True
        self.status = status
        # No per-header checks (lowproxy/h11_internals/): decode's headers were
        # checked by h11's parser, the rest are the proxy's own.
        event = response(status, headers, REASONS.get(status, b""))
        self._out.append(send_response(wire.h11, event))
        # h11 chunks a 1.1 response that has no length (RFC 9112 6.1); we then
        # frame chunks ourselves, which is all h11's chunked writer does, at a
        # fraction of the cost per chunk. Other framings go through h11.
        self._chunked = (content_length is None and wire.h11.their_http_version == b"1.1"
                         and not self._head and status >= 200 and status not in (204, 304))

    def informational(self, status: int, headers: Headers) -> None:
        """A 1xx before the final response (RFC 9110 15.2: a proxy forwards those it
        did not ask for), written at once; never to an HTTP/1.0 client."""
        wire = self._wire
        if self.started or wire.h11.their_http_version != b"1.1":
            return
        event = informational(status, headers, REASONS.get(status, b""))
        wire.write(wire.h11.send(event))

    def buffer(self, data: bytes) -> None:
        """Collect one piece of the body; nothing is written yet."""
        if not data or self._head:
            return
        self.bytes_out += len(data)
        if self._chunked:
            self._out.append(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self._out.append(send_data(self._wire.h11, data))

    def flush(self) -> None:
        """Write what was collected, in one syscall, without waiting."""
        out = self._out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            self._wire.write(data)

    def relay(self, pieces: list[bytes]) -> bool:
        """The pieces one upstream read brought, written now; whether the client is slow.

        ``buffer`` and ``flush`` in one call: a streamed token costs one
        formatted chunk and one write (the head, when still unsent, goes with it).
        """
        wire = self._wire
        if self._chunked and not self._out and len(pieces) == 1:
            # Wire.write and write_buffer_size, inlined: this runs once per event.
            transport = wire.transport
            if transport.is_closing():
                raise ClientGone()
            data = pieces[0]
            if data:
                self.bytes_out += len(data)
                transport.write(b"%x\r\n%s\r\n" % (len(data), data))
            return transport.get_write_buffer_size() > WRITE_HIGH_WATER
        for piece in pieces:
            self.buffer(piece)
        self.flush()
        return wire.write_buffer_size() > WRITE_HIGH_WATER

    async def write(self, data: bytes) -> None:
        self.buffer(data)
        self.flush()
        await self._wire.drain()

    async def end(self) -> None:
        self.ended = True
        self._out.append(send_end(self._wire.h11))
        self.flush()
        await self._wire.drain()

    @property
    def client_is_slow(self) -> bool:
        """More is queued for the client than its socket takes: wait (back-pressure)."""
        return self._wire.write_buffer_size() > WRITE_HIGH_WATER

    async def wait_for_client(self) -> None:
        await self._wire.drain()

    async def send_bytes(self, status: int, body: bytes,
                         headers: Headers | None = None) -> None:
        """A whole small response: one write, one drain."""
        headers = [(b"content-type", b"application/json")] if headers is None else headers
        headers.append((b"content-length", str(len(body)).encode()))
        if self._extra:
            self._with_extra(headers)
        wire = self._wire
        if wire.draining:
            headers.append((b"connection", b"close"))
        self.started = True
        self.ended = True
        self.status = status
        if self._head:
            body = b""
        self.bytes_out += len(body)
        conn = wire.h11
        out = send_response(conn, response(status, headers, REASONS.get(status, b"")))
        if body:
            out += send_data(conn, body)
        out += send_end(conn)
        wire.write(out)
        await wire.drain()

    async def send_json(self, status: int, obj: Any,
                        headers: Headers | None = None) -> None:
        extra = [(b"content-type", b"application/json")]
        if headers:
            extra.extend(headers)
        await self.send_bytes(status, json_body(obj), extra)

    def drop(self) -> None:
        """Close the connection at once, with no (further) response bytes."""
        self.ended = False
        self._wire.drop()

    @property
    def client_gone(self) -> bool:
        return self._wire.gone
