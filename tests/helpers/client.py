"""The one HTTP/1.1 test client: h11 over a real socket, or over bytes a server sent.

``request`` is one exchange on a fresh connection; ``Client`` drives one
connection: whole exchanges in turn (keep-alive), a stream read while it is in
flight (``read_until``), event by event (``next_event``), or the answers to
requests a test wrote as raw bytes (``sent_raw``, pipelining). ``parse_replies``
and ``first_reply`` read the same way from bytes already received.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl as ssl_module
from typing import Any, Iterable

import h11

HeaderItems = Iterable[tuple[str | bytes, str | bytes]]


@dataclasses.dataclass
class Reply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    complete: bool = True  # False: the connection ended before the body did
    http_version: bytes = b"1.1"

    def header(self, name: str) -> bytes | None:
        key = name.lower().encode()
        for header, value in self.headers:
            if header.lower() == key:
                return value
        return None

    def header_values(self, name: str) -> list[bytes]:
        key = name.lower().encode()
        return [value for header, value in self.headers if header.lower() == key]

    def json(self) -> Any:
        return json.loads(self.body)


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _took(event: Any, reply: Reply, parts: list[bytes]) -> bool:
    """Fold one h11 event into ``reply``; True once the response has ended."""
    if isinstance(event, h11.Response):
        reply.status, reply.headers = event.status_code, list(event.headers.raw_items())
        reply.http_version = event.http_version
    elif isinstance(event, h11.Data):
        parts.append(bytes(event.data))
    elif isinstance(event, h11.EndOfMessage):
        reply.complete = True
        return True
    elif isinstance(event, h11.ConnectionClosed):
        return True
    return False  # an informational response, or nothing yet


class Client:
    """One client connection driven by h11 (see the module's docstring)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.CLIENT)
        self._reply: Reply | None = None  # the response being read
        self._parts: list[bytes] = []

    @classmethod
    async def open(cls, port: int, *, ssl: ssl_module.SSLContext | None = None,
                   server_hostname: str | None = None) -> Client:
        return cls(*await asyncio.open_connection("127.0.0.1", port, ssl=ssl,
                                                  server_hostname=server_hostname))

    def _next_cycle(self) -> None:
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()

    def send(self, method: str, target: str, body: Any = None, *, headers: HeaderItems = (),
             raw_body: bytes | None = None, host: str = "127.0.0.1") -> None:
        """Write one request: ``body`` as JSON, or ``raw_body`` as is."""
        self._next_cycle()
        if raw_body is None and body is not None:
            raw_body = json.dumps(body).encode()
        wire = [(b"host", host.encode())]
        wire += [(_b(k), _b(v)) for k, v in headers]
        if raw_body is not None:
            wire.append((b"content-length", str(len(raw_body)).encode()))
            if not any(k.lower() == b"content-type" for k, _ in wire):
                wire.append((b"content-type", b"application/json"))
        data = self.conn.send(h11.Request(method=method, target=target, headers=wire))
        if raw_body:
            data += self.conn.send(h11.Data(data=raw_body))
        data += self.conn.send(h11.EndOfMessage())
        self.writer.write(data)

    def sent_raw(self, method: str = "GET") -> None:
        """The test wrote a request as raw bytes: the next response answers it."""
        self._next_cycle()
        self.conn.send(h11.Request(method=method, target="/",
                                   headers=[(b"host", b"x"), (b"content-length", b"0")]))
        self.conn.send(h11.EndOfMessage())

    async def next_event(self, timeout: float | None = 5.0) -> Any:
        """The next h11 event (h11's errors and a reset connection raise)."""
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await asyncio.wait_for(self.reader.read(65536), timeout))

    async def _read(self, until: bytes | None, reset_ends: bool = False) -> Reply:
        """Read the current response to its end, or until its body holds ``until``.

        A connection closed mid-body ends the reply (``complete`` False), and so
        does a reset with ``reset_ends``; bytes that are not HTTP raise h11's error.
        """
        if self._reply is None:
            self._reply, self._parts = Reply(0, [], b"", False), []
        reply, parts = self._reply, self._parts
        while until is None or until not in b"".join(parts):
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await self.reader.read(65536)
                except ConnectionError:
                    if not reset_ends:
                        raise
                    data = b""
                try:
                    self.conn.receive_data(data)
                except h11.RemoteProtocolError:
                    event = h11.ConnectionClosed()
                else:
                    if data or self.conn.their_state is not h11.SEND_BODY:
                        continue
                    event = h11.ConnectionClosed()  # closed mid-body: cut
            if _took(event, reply, parts):
                self._reply = None  # the next read is of the next response
                break
        reply.body = b"".join(parts)
        return reply

    async def reply(self, timeout: float = 10.0, *, reset_ends: bool = False) -> Reply:
        """The whole response (what a ``read_until`` already read included)."""
        return await asyncio.wait_for(self._read(None, reset_ends), timeout)

    async def read_until(self, data: bytes, timeout: float = 10.0) -> Reply:
        """The response so far, once its body holds ``data`` (a stream in flight)."""
        return await asyncio.wait_for(self._read(data), timeout)

    def close(self) -> None:
        self.writer.close()


async def request(port: int, method: str, target: str, body: Any = None, *,
                  headers: HeaderItems = (), raw_body: bytes | None = None,
                  timeout: float = 10.0) -> Reply:
    """One request on a fresh connection, read to the end (or to the connection's end)."""
    client = await Client.open(port)
    try:
        client.send(method, target, body, headers=headers, raw_body=raw_body)
        return await client.reply(timeout)
    finally:
        client.close()


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str,
                   target: str, body: Any = None, *, headers: HeaderItems = (),
                   raw_body: bytes | None = None) -> Reply:
    """One request and its response on a connection the caller keeps open."""
    client = Client(reader, writer)
    client.send(method, target, body, headers=headers, raw_body=raw_body)
    return await client._read(None)


def first_reply(raw: bytes, head_only: bool = False) -> tuple[Reply, bytes]:
    """The first response in ``raw`` (bytes a server sent), and the bytes after it.

    A response cut short comes with ``complete`` False; bytes that are not HTTP
    give a Reply of status 0.
    """
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="HEAD" if head_only else "GET", target="/",
                          headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    conn.receive_data(b"")
    reply = Reply(0, [], b"", False)
    parts: list[bytes] = []
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED or _took(event, reply, parts):
                break
    except h11.RemoteProtocolError:
        pass
    reply.body = b"".join(parts)
    return reply, conn.trailing_data[0] if reply.complete else b""


def parse_replies(raw: bytes, head_only: bool = False) -> list[Reply]:
    """The responses in ``raw`` (bytes a server sent on one connection), in order."""
    replies: list[Reply] = []
    rest = raw
    while rest:
        reply, rest = first_reply(rest, head_only)
        replies.append(reply)
        if not reply.complete:
            break
    return replies
