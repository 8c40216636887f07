"""The HTTP/1.1 server: listen, accept, cap the connections, drain on shutdown.

Each accepted socket gets one ClientConnection (connection.py), which runs
its request cycles; limits (head and body size, timeouts, methods) are
enforced there, before any handler runs, so bad input never reaches a backend.
"""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_module
from typing import Callable

from ..answers import canned_response, error_body
from .connection import READ_SIZE, ClientConnection, Handler
from .limits import Limits

__all__ = ["HttpServer", "Limits"]

# How long a closed connection may take to flush what it still has queued.
CLOSE_GRACE = 10.0


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
        self._servers: list[asyncio.Server] = []
        self._on_connections = on_connections
        self._tls_socket: socket.socket | None = None  # the socket served with TLS

    async def listen(self, host: str | None, port: int, *, reuse_port: bool = False,
                     sock: socket.socket | None = None,
                     ssl: ssl_module.SSLContext | None = None) -> asyncio.Server:
        """Listen on host:port (or an already bound ``sock``); TLS when ``ssl`` is given."""
        self.draining = False  # listening (again) means serving
        # A TLS handshake happens before _accept runs: bound it like a request head.
        handshake = self.limits.header_timeout if ssl is not None else None
        if sock is not None:
            server = await asyncio.start_server(self._accept, sock=sock, limit=READ_SIZE,
                                                backlog=2048, ssl=ssl,
                                                ssl_handshake_timeout=handshake)
            self._tls_socket = sock if ssl is not None else None
        else:
            server = await asyncio.start_server(self._accept, host, port, limit=READ_SIZE,
                                                reuse_port=reuse_port or None, backlog=2048,
                                                ssl=ssl, ssl_handshake_timeout=handshake)
        self._servers.append(server)
        return server

    async def use_tls(self, context: ssl_module.SSLContext) -> None:
        """Serve new connections of the TLS socket with ``context`` (a renewed certificate).

        asyncio.start_server fixes one context per listener, so a second
        listener starts on a duplicate of the same listening socket (one queue
        of connections in the kernel: none is refused or lost) and the old one
        stops accepting; connections it accepted carry on under the old
        context. Mutating the live context instead (load_cert_chain again)
        could leave it half-updated when a rotation is half-written, and
        cannot drop a client CA that was removed.
        """
        if self._tls_socket is None or self.draining:
            return
        old = [server for server in self._servers if server.is_serving()]
        sock = self._tls_socket.dup()
        server = await asyncio.start_server(self._accept, sock=sock, limit=READ_SIZE,
                                            backlog=2048, ssl=context,
                                            ssl_handshake_timeout=self.limits.header_timeout)
        self._servers.append(server)
        self._tls_socket = sock  # the old socket object closes with its listener
        for listener in old if not self.draining else self._servers:
            listener.close()

    @property
    def ports(self) -> list[int]:
        return [s.getsockname()[1] for srv in self._servers for s in srv.sockets]

    def _is_draining(self) -> bool:
        return self.draining

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.connections) >= self.limits.max_connections or self.draining:
            message = "shutting down" if self.draining else "too many connections"
            writer.write(canned_response(503, error_body(503, message, "unavailable")))
            writer.close()
            await _closed(writer)
            return
        connection = ClientConnection(reader, writer, self.handler, self.limits,
                                      self._is_draining)
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
