"""The HTTP/1.1 server: asyncio.start_server, one h11 connection per socket.

One ClientConnection per socket runs request cycles in order (keep-alive and
pipelining: a cycle finishes before the next request is parsed, as in uvicorn's
h11 protocol). Each cycle reads the whole request body (bounded), hands a
ClientRequest and a Responder to the handler, and ends the connection when the
exchange cannot continue cleanly. Limits (head size, body size, head and idle
timeouts, connection count, methods) are enforced here, before any handler
runs, so bad input never reaches a backend.

Two phases of error: before a response has started the client gets a status
and a JSON body; after it has started the connection is aborted, so a cut
response never looks complete.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_module
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import h11

from .messages import (REASONS, AbortResponse, ClientGone, ClientRequest, Responder,
                       canned_response, error_body, json_body)
from .timeouts import deadline

__all__ = ["AbortResponse", "ClientGone", "ClientRequest", "HttpServer", "Limits", "Responder",
           "canned_response", "error_body", "json_body"]

log = logging.getLogger("lowproxy.server")

READ_SIZE = 64 * 1024
# A handler waiting on a backend longer than this starts watching its client for
# a hang-up; the many exchanges that end sooner never pay for the watcher task.
WATCH_AFTER = 0.05
# After refusing a request, how long and how much of its remaining input to drop.
LINGER_SECONDS = 2.0
LINGER_BYTES = 4 * 1024 * 1024
# How long a closed connection may take to flush what it still has queued.
CLOSE_GRACE = 10.0
ALLOWED_METHODS = (b"GET", b"POST", b"HEAD", b"OPTIONS")


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    max_connections: int = 10000


Handler = Callable[[ClientRequest, Responder], Awaitable[None]]


class ClientConnection:
    """One client socket: the h11 state, its one timer, and its request cycles."""

    def __init__(self, server: "HttpServer", reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.transport = writer.transport
        # Cached: asyncio.get_running_loop() costs a getpid() syscall on 3.11.
        self._loop = asyncio.get_running_loop()
        self.h11 = h11.Connection(h11.SERVER,
                                  max_incomplete_event_size=server.limits.max_header_bytes)
        self.gone = False
        self._peer_closed = False
        self.busy = False  # a request is being handled (drain waits for it)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""
        self._watcher: asyncio.Task[None] | None = None
        self._watch_later: asyncio.TimerHandle | None = None
        self._pending: list[bytes] = []
        self._head_bytes = 0
        self._linger = False  # a refused request may still be arriving
        self._head_reads: list[bytes] | None = None  # this cycle's reads until its head
        self._task: asyncio.Task[Any] | None = None

    # -- the one timer: idle keep-alive, head arrival, body inactivity

    def _arm(self, kind: str, seconds: float) -> None:
        self._disarm()
        self._timer_kind = kind
        self._timer = self._loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_kind = ""

    def _expired(self) -> None:
        self._timer = None
        if self._timer_kind in ("head", "body") and not self.transport.is_closing():
            # RFC 9110 15.5.9: a 408 tells the client why before the close.
            self.transport.write(canned_response(
                408, error_body(408, "request not received in time", "request_timeout")))
        self.close()

    def close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        self.transport.abort()

    # -- I/O

    async def send(self, data: bytes | None) -> None:
        if not data:
            return
        self.write(data)
        await self.drain()

    def write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ClientGone()
        self.transport.write(data)

    async def drain(self) -> None:
        if self.transport.is_closing():
            raise ClientGone()
        try:
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            raise ClientGone() from None

    async def _read(self) -> bytes:
        watcher = self._watcher
        if watcher is not None:
            # The watcher owns the pending read until it returns; take its bytes.
            self._watcher = None
            await watcher
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            return data
        if self.gone or self._peer_closed:
            return b""
        try:
            return await self.reader.read(READ_SIZE)
        except (ConnectionError, OSError):
            return b""

    def watch_client(self) -> None:
        """While a handler waits on a backend, read the socket to notice a hang-up.

        A hang-up cancels the handler's task, which closes its upstream
        exchange at once (a decode server aborts the request when its
        connection drops). Bytes of a pipelined next request are kept for the
        next cycle, up to the head limit; past that reading stops and TCP
        pushes back. The watcher keeps its read pending after the cycle: the
        next read awaits it rather than racing it.
        """
        if self._watcher is None and self._watch_later is None and not self.gone:
            # Most exchanges end within WATCH_AFTER: they never pay for a task.
            self._watch_later = self._loop.call_later(WATCH_AFTER, self._start_watching)

    def _start_watching(self) -> None:
        self._watch_later = None
        if self.busy and self._watcher is None and not self.gone:
            self._watcher = self._loop.create_task(self._watch())

    async def _watch(self) -> None:
        size = 0
        while True:
            try:
                data = await self.reader.read(READ_SIZE)
            except (ConnectionError, OSError):
                data = b""
            if not data:
                self._peer_closed = True
                if self.busy and self._task is not None:
                    # Mid-request: the client left. Between requests, an EOF only
                    # means no more requests; what we wrote still gets flushed.
                    self.gone = True
                    self._task.cancel()
                return
            self._pending.append(data)
            size += len(data)
            if not self.busy or size > self.server.limits.max_header_bytes:
                return

    def _stop_watching(self) -> None:
        if self._watch_later is not None:
            self._watch_later.cancel()
            self._watch_later = None
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.cancel()

    async def _next_event(self) -> Any:
        conn = self.h11
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self._read()
            self._head_bytes += len(data)
            if self._head_reads is not None:
                self._head_reads.append(data)
            if data and self._timer_kind == "idle":
                self._arm("head", self.server.limits.header_timeout)
            elif data and self._timer_kind == "body":
                self._arm("body", self.server.limits.header_timeout)
            conn.receive_data(data)

    # -- request cycles

    async def run(self) -> None:
        self._task = asyncio.current_task()
        limits = self.server.limits
        first = True
        try:
            while not self.transport.is_closing():
                if first:
                    self._arm("head", limits.header_timeout)
                else:
                    self._arm("idle", limits.keepalive_timeout)
                first = False
                if not await self._cycle():
                    break
                self.h11.start_next_cycle()
        except ClientGone:
            pass
        except asyncio.CancelledError:
            if not self.gone:
                raise
        except Exception:  # pragma: no cover - a bug; keep serving others
            log.exception("connection failed")
        finally:
            self._disarm()
            self._stop_watching()
            if self._linger and not self.gone:
                await self._linger_then_close()
            self.abort() if self.gone else self.close()

    async def _linger_then_close(self) -> None:
        """After refusing a request, read and drop what the client still sends.

        Closing a socket with unread input makes the kernel send a reset, which
        can reach the client before our 413 or 400 and hide it. So the write
        side is shut (the client sees the end of the response), and input is
        drained for a bounded time before the close (as Apache's lingering
        close does).
        """
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
            drained = 0
            async with deadline(LINGER_SECONDS):
                while drained < LINGER_BYTES:
                    data = await self._read()
                    if not data:
                        break
                    drained += len(data)
        except (TimeoutError, ConnectionError, OSError, RuntimeError):
            pass

    async def _cycle(self) -> bool:
        """One request and its response; False when the connection must end."""
        request = await self._receive_request()
        if request is None:
            return False
        return await self._respond(request)

    async def _receive_request(self) -> ClientRequest | None:
        """The next request, head checked and body read; None once refused or closed."""
        conn = self.h11
        limits = self.server.limits
        leftover = conn.trailing_data[0]
        self._head_bytes = len(leftover)
        self._head_reads = [leftover]
        try:
            event = await self._next_event()
            head_reads, self._head_reads = self._head_reads, None
            if isinstance(event, h11.ConnectionClosed):
                return None
            assert isinstance(event, h11.Request), event
            # h11 parses a head that arrived whole whatever its size; its own
            # limit only bounds a head still incomplete. Measure what it consumed.
            head_size = self._head_bytes - len(conn.trailing_data[0])
            refusal = _refusal(event, head_reads or [b""], head_size, limits)
            if refusal is not None:
                await self._reject(*refusal)
                return None
            if conn.client_is_waiting_for_100_continue:
                await self.send(conn.send(h11.InformationalResponse(
                    status_code=100, headers=[], reason=b"Continue")))
            body = await self._receive_body()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            if status >= 500:
                # h11 hints 501 for a transfer coding other than chunked (RFC 9112
                # 6.1). The request cannot be framed, which is the client's fault:
                # nothing a client sends may earn a 5xx other than 505.
                status = 400
            if status == 431:
                await self._reject(431, "request header fields too large", "header_too_large")
            else:
                await self._reject(status, f"malformed request: {str(exc) or 'unreadable'}",
                                   "bad_request")
            return None
        if body is None:
            return None
        self._disarm()
        return ClientRequest(event.method, event.target, list(event.headers), body,
                             event.http_version)

    async def _receive_body(self) -> bytes | None:
        """The whole body, bounded; None once refused (413) or the client left."""
        limits = self.server.limits
        self._arm("body", limits.header_timeout)
        parts: list[bytes] = []
        size = 0
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limits.max_body_bytes:
                    await self._reject(413, "request body too large", "request_too_large")
                    return None
                parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                # h11 hands out bytearrays; a body is immutable bytes from here on
                # (httpcore sends only bytes: a GET's body is forwarded as is).
                return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
            else:  # ConnectionClosed mid-body
                return None

    async def _respond(self, request: ClientRequest) -> bool:
        """Run the handler; True when the connection can serve another request."""
        conn = self.h11
        responder = Responder(self, head=request.method == b"HEAD")
        self.busy = True
        try:
            await self.server.handler(request, responder)
        except ClientGone:
            raise
        except AbortResponse:
            # The handler logged why; a started response is cut, never completed.
            if responder.started:
                responder.flush()
            else:
                await responder.send_bytes(
                    502, error_body(502, "bad gateway", "upstream_error"))
            return False
        except Exception:
            log.exception("handler failed on %s %s", request.method.decode(), request.path)
            if responder.started:
                return False
            await responder.send_bytes(
                500, error_body(500, "internal proxy error", "internal_error"))
        finally:
            self.busy = False
            if self._watch_later is not None:
                self._watch_later.cancel()
                self._watch_later = None
        if not responder.ended:
            return False
        if self.gone or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return False
        if self._pending:
            conn.receive_data(b"".join(self._pending))
            self._pending.clear()
        return True

    async def _reject(self, status: int, message: str, kind: str,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer a request we will not serve, then the connection closes."""
        body = error_body(status, message, kind)
        extra = b"".join(name + b": " + value + b"\r\n" for name, value in headers or ())
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                response = h11.Response(status_code=status, reason=REASONS.get(status, b""),
                                        headers=[(b"content-type", b"application/json"),
                                                 (b"content-length", str(len(body)).encode()),
                                                 (b"connection", b"close"),
                                                 *(headers or ())])
                data = self.h11.send(response) + self.h11.send(h11.Data(data=body))
                data += self.h11.send(h11.EndOfMessage())
            except h11.LocalProtocolError:
                data = canned_response(status, body, extra)
        else:
            data = canned_response(status, body, extra)
        try:
            await self.send(data)
        except ClientGone:
            return
        self._linger = True


def _refusal(event: h11.Request, head_reads: list[bytes], head_size: int,
             limits: Limits) -> tuple[Any, ...] | None:
    """Why a parsed request head is refused, as _reject's arguments; None to serve it."""
    if event.http_version not in (b"1.0", b"1.1"):
        return 505, "HTTP version not supported", "bad_request"
    if event.method not in ALLOWED_METHODS:
        return (405, "method not allowed", "method_not_allowed",
                [(b"allow", b", ".join(ALLOWED_METHODS))])
    if head_size > limits.max_header_bytes:
        return 431, "request header fields too large", "header_too_large"
    declared = None
    chunked = False
    for name, value in event.headers:
        if name == b"content-length":
            declared = int(value)
        elif name == b"transfer-encoding":
            chunked = True
    if declared is not None and chunked:
        # RFC 9112 6.3: a request smuggling vector; h11 would take chunked.
        return 400, "Content-Length with Transfer-Encoding", "bad_request"
    if chunked and event.http_version == b"1.0":
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty
        # framing (a 1.0 hop before us may have framed it otherwise).
        return 400, "Transfer-Encoding in HTTP/1.0", "bad_request"
    problem = _head_problem(head_reads, head_size, declared is not None)
    if problem:
        return 400, f"malformed request: {problem}", "bad_request"
    if declared is not None and declared > limits.max_body_bytes:
        return 413, "request body too large", "request_too_large"
    return None


def _head_problem(reads: list[bytes], size: int, has_length: bool) -> str | None:
    """What h11 forgives in a request head that a proxy must refuse; None if nothing.

    h11 joins obs-fold continuation lines and merges repeated equal
    Content-Length values. An origin server may (RFC 9112 5.2, RFC 9110 8.6),
    but a proxy refuses both: a parser on another hop may frame the same bytes
    differently, which is how requests are smuggled. ``reads`` hold the head in
    their first ``size`` bytes.
    """
    head = reads[0] if len(reads) == 1 else b"".join(reads)
    if head.find(b"\n ", 0, size) >= 0 or head.find(b"\n\t", 0, size) >= 0:
        return "obsolete line folding"
    if has_length:
        lowered = head[:size].lower()
        start = lowered.find(b"\ncontent-length:")
        if lowered.find(b"\ncontent-length:", start + 1) >= 0:
            return "repeated Content-Length"
        if b"," in lowered[start:lowered.find(b"\n", start + 1)]:
            return "Content-Length list"
    return None


async def _closed(writer: asyncio.StreamWriter) -> None:
    """Wait for a closed connection to be gone; abort one whose peer will not read.

    close() flushes what is queued first, which a client that stopped reading
    never lets happen: after CLOSE_GRACE the socket is aborted, so no fd
    outlives its client. Awaiting also collects the reset error asyncio keeps
    for a peer that reset, which it would otherwise report as never retrieved.
    """
    try:
        await asyncio.wait_for(writer.wait_closed(), CLOSE_GRACE)
    except asyncio.TimeoutError:
        writer.transport.abort()
    except (ConnectionError, OSError):
        pass


class HttpServer:
    """Listens, counts connections, and drains on shutdown."""

    def __init__(self, handler: Handler, limits: Limits | None = None,
                 on_connections: Callable[[int], None] | None = None) -> None:
        self.handler = handler
        self.limits = limits or Limits()
        self.draining = False
        self.connections: set[ClientConnection] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._on_connections = on_connections
        self._tasks: set[asyncio.Task[Any]] = set()

    async def listen(self, host: str | None, port: int, *, reuse_port: bool = False,
                     sock: socket.socket | None = None,
                     ssl: "ssl_module.SSLContext | None" = None) -> asyncio.AbstractServer:
        """Listen on host:port (or an already bound ``sock``); TLS when ``ssl`` is given.

        The proxy itself serves plain HTTP behind a TLS sidecar; ``ssl`` is for
        test and demo backends that stand in for an https:// vLLM.
        """
        self.draining = False  # listening (again) means serving
        if sock is not None:
            server = await asyncio.start_server(self._accept, sock=sock, limit=READ_SIZE,
                                                backlog=2048, ssl=ssl)
        else:
            server = await asyncio.start_server(self._accept, host, port, limit=READ_SIZE,
                                                reuse_port=reuse_port or None, backlog=2048,
                                                ssl=ssl)
        self._servers.append(server)
        return server

    @property
    def ports(self) -> list[int]:
        return [s.getsockname()[1] for srv in self._servers for s in srv.sockets]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.connections) >= self.limits.max_connections or self.draining:
            status, message = (503, "too many connections") if not self.draining else (
                503, "shutting down")
            writer.write(canned_response(status, error_body(status, message, "unavailable")))
            writer.close()
            await _closed(writer)
            return
        connection = ClientConnection(self, reader, writer)
        self.connections.add(connection)
        if self._on_connections:
            self._on_connections(1)
        try:
            await connection.run()
        finally:
            self.connections.discard(connection)
            if self._on_connections:
                self._on_connections(-1)
        await _closed(writer)

    def stop_accepting(self) -> None:
        for server in self._servers:
            server.close()

    async def drain(self, seconds: float) -> None:
        """Stop accepting; let requests in flight finish for ``seconds``; close the rest.

        Idle keep-alive connections stay open while requests are in flight, so a
        client (or a probe) on one can still be told we are draining: every
        response now carries ``connection: close``, and the handler may refuse
        new work. Once nothing is in flight, or at the deadline, all close.
        """
        self.draining = True
        self.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while any(c.busy for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            if connection.busy:
                connection.abort()
            else:
                connection.close()
        for server in self._servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 1.0)
            except asyncio.TimeoutError:  # pragma: no cover
                pass
