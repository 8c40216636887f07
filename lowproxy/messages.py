"""What a handler sees of one exchange: the request, and the Responder that answers it.

The Responder frames and writes through its connection (server.py), which
owns the socket and the h11 state.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import h11

if TYPE_CHECKING:
    from .server import ClientConnection

# Past this much unsent to a client, stop relaying until it catches up.
WRITE_HIGH_WATER = 64 * 1024
REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


class ClientGone(Exception):
    """The client closed its connection or stopped accepting our bytes."""


class AbortResponse(Exception):
    """Raised by a handler to cut the response short: the connection closes with
    what was sent so far (no final chunk), so the client sees a truncated body."""


class ClientRequest:
    __slots__ = ("method", "target", "path", "headers", "body", "http_version")

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                 body: bytes, http_version: bytes) -> None:
        self.method = method
        self.target = target  # path and query exactly as received
        path = target.split(b"?", 1)[0]
        self.path = path.decode("latin-1")
        self.headers = headers  # lowercased names, raw values, in order
        self.body = body
        self.http_version = http_version

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


def json_body(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def error_body(status: int, message: str, kind: str) -> bytes:
    return json_body({"error": {"message": message, "type": kind, "code": status}})


def canned_response(status: int, body: bytes, extra: bytes = b"") -> bytes:
    """A whole response written without h11, for sockets h11 can no longer serve."""
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n%s\r\n" % (status, REASONS.get(status, b""), len(body), extra)
            ) + body


class Responder:
    """How a handler answers: start (status, headers), write chunks, end.

    Framing is the server's: a ``content_length`` passed to ``start`` is kept and
    enforced, otherwise the body is chunked (HTTP/1.1) or close-delimited
    (HTTP/1.0). Bytes are collected and written in as few syscalls as the
    handler allows: ``buffer`` only collects, ``flush`` writes what was
    collected, ``write`` and ``end`` flush and wait while the client is slow.
    """

    __slots__ = ("_conn", "started", "ended", "status", "bytes_out", "_head", "_chunked",
                 "_out")

    def __init__(self, conn: "ClientConnection", head: bool) -> None:
        self._conn = conn
        self._head = head
        self.started = False
        self.ended = False
        self.status = 0
        self.bytes_out = 0
        self._chunked = False
        self._out: list[bytes] = []

    async def start(self, status: int, headers: list[tuple[bytes, bytes]],
                    content_length: int | None = None) -> None:
        """Begin the response; its head goes out with the first flush."""
        headers = list(headers)
        if content_length is not None:
            headers.append((b"content-length", str(content_length).encode()))
        conn = self._conn
        if conn.server.draining:
            headers.append((b"connection", b"close"))
        self.started = True
        self.status = status
        event = h11.Response(status_code=status, headers=headers,
                             reason=REASONS.get(status, b""))
        self._out.append(conn.h11.send(event))
        # h11 chunks a 1.1 response that has no length (RFC 9112 6.1); we then
        # frame chunks ourselves, which is all h11's chunked writer does, at a
        # fraction of the cost per chunk. Other framings go through h11.
        self._chunked = (content_length is None and conn.h11.their_http_version == b"1.1"
                         and not self._head and status >= 200 and status not in (204, 304))

    def buffer(self, data: bytes) -> None:
        """Collect one piece of the body; nothing is written yet."""
        if not data or self._head:
            return
        self.bytes_out += len(data)
        if self._chunked:
            self._out.append(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self._out.append(self._conn.h11.send(h11.Data(data=data)))

    def flush(self) -> None:
        """Write what was collected, in one syscall, without waiting."""
        out = self._out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            self._conn.write(data)

    async def write(self, data: bytes) -> None:
        self.buffer(data)
        self.flush()
        await self._conn.drain()

    async def end(self) -> None:
        self.ended = True
        self._out.append(self._conn.h11.send(h11.EndOfMessage()))
        self.flush()
        await self._conn.drain()

    @property
    def client_is_slow(self) -> bool:
        """More is queued for the client than its socket takes: wait (back-pressure)."""
        return self._conn.transport.get_write_buffer_size() > WRITE_HIGH_WATER

    async def wait_for_client(self) -> None:
        await self._conn.drain()

    async def send_bytes(self, status: int, body: bytes,
                         headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """A whole small response: one write, one drain."""
        headers = [(b"content-type", b"application/json")] if headers is None else headers
        headers.append((b"content-length", str(len(body)).encode()))
        if self._conn.server.draining:
            headers.append((b"connection", b"close"))
        self.started = True
        self.ended = True
        self.status = status
        if self._head:
            body = b""
        self.bytes_out += len(body)
        conn = self._conn.h11
        out = conn.send(h11.Response(status_code=status, headers=headers,
                                     reason=REASONS.get(status, b"")))
        if body:
            out += conn.send(h11.Data(data=body))
        out += conn.send(h11.EndOfMessage())
        await self._conn.send(out)

    async def send_json(self, status: int, obj: Any,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
        extra = [(b"content-type", b"application/json")]
        if headers:
            extra.extend(headers)
        await self.send_bytes(status, json_body(obj), extra)

    def drop(self) -> None:
        """Close the connection at once, with no (further) response bytes."""
        self.ended = False
        self._conn.gone = True
        self._conn.abort()

    def watch_client(self) -> None:
        """Notice a client that hangs up while the handler waits (see ClientConnection)."""
        self._conn.watch_client()

    @property
    def client_gone(self) -> bool:
        return self._conn.gone
