"""The HTTP/1.1 server: listen, accept, cap the connections, drain on shutdown.

Each accepted socket gets one ClientConnection (connection.py), which runs
its request cycles; limits (head and body size, timeouts, methods) are
enforced there, before any handler runs, so bad input never reaches a backend.

PD_PROXY_MAX_CONNECTIONS counts a connection from accept on. On a TLS listener
that includes its handshake: asyncio's own TLS listener (start_server with
ssl=) handshakes before anything of ours runs, so thousands of stalled
handshakes would hold a socket each, uncounted. A TLS listener here accepts
plain sockets itself (loop.sock_accept), refuses those beyond the cap at once,
and handshakes the rest under a bound of their own (tls_handshake_timeout)
with loop.connect_accepted_socket, which asyncio and uvloop both provide.
Attaching a plain stream first and upgrading it (StreamWriter.start_tls) is
not an option: the reader may already have consumed the ClientHello.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_module
from typing import Any, Callable, Coroutine

from ..answers import canned_response, error_body
from ..asyncio_internals import read_in_heap_sized_pieces, slim_drain_waiters
from .closing import closed
from .connection import READ_SIZE, ClientConnection, Handler
from .limits import Limits

__all__ = ["HttpServer", "Limits"]

log = logging.getLogger("lowproxy.server")

# After accept() failed (EMFILE: out of file descriptors), before the next one.
ACCEPT_RETRY_SECONDS = 0.1


class HttpServer:
    """Listens, counts connections, and drains on shutdown."""

    def __init__(self, handler: Handler, limits: Limits | None = None,
                 on_connections: Callable[[int], None] | None = None) -> None:
        self.handler = handler
        self.limits = limits or Limits()
        self.draining = False
        self.connections: set[ClientConnection] = set()
        self.handshaking = 0  # accepted TLS connections still in their handshake
        self._servers: list[asyncio.Server] = []
        self._on_connections = on_connections
        self._tls_context: ssl_module.SSLContext | None = None  # for new TLS connections
        self._tls_sockets: list[socket.socket] = []
        self._tls_accepting: list[asyncio.Task[None]] = []
        self._tls_connections: set[asyncio.Task[None]] = set()  # strong references
        self._handshakes: set[asyncio.Task[None]] = set()  # those still handshaking

    async def listen(self, host: str | None, port: int, *, reuse_port: bool = False,
                     sock: socket.socket | None = None,
                     ssl: ssl_module.SSLContext | None = None) -> asyncio.Server | None:
        """Listen on host:port (or an already bound ``sock``); TLS when ``ssl`` is given."""
        self.draining = False  # listening (again) means serving
        if ssl is not None:
            await self._listen_tls(host, port, reuse_port, sock, ssl)
            return None
        if sock is not None:
            server = await asyncio.start_server(self._accept, sock=sock, limit=READ_SIZE,
                                                backlog=2048)
        else:
            server = await asyncio.start_server(self._accept, host, port, limit=READ_SIZE,
                                                reuse_port=reuse_port or None, backlog=2048)
        self._servers.append(server)
        return server

    async def use_tls(self, context: ssl_module.SSLContext) -> None:
        """Serve new connections of the TLS listener with ``context`` (a renewed certificate).

        Each accepted connection takes the context current at its accept, so
        connections already accepted carry on under the old one and none is
        refused or lost. Mutating the live context instead (load_cert_chain
        again) could leave it half-updated when a rotation is half-written, and
        cannot drop a client CA that was removed.
        """
        if self._tls_sockets and not self.draining:
            self._tls_context = context

    @property
    def ports(self) -> list[int]:
        return ([s.getsockname()[1] for srv in self._servers for s in srv.sockets]
                + [s.getsockname()[1] for s in self._tls_sockets if s.fileno() >= 0])

    def _is_draining(self) -> bool:
        return self.draining

    def _full(self) -> bool:
        return len(self.connections) + self.handshaking >= self.limits.max_connections

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                ) -> Coroutine[Any, Any, None]:
        """start_server's callback: the coroutine its task runs for this connection.

        A plain function returning it, not a coroutine awaiting it: a frame fewer
        held by every open connection.
        """
        if self._full() or self.draining:
            message = "shutting down" if self.draining else "too many connections"
            writer.write(canned_response(503, error_body(503, message, "unavailable")))
            writer.close()
            return closed(writer)
        if self._on_connections:
            self._on_connections(1)
        return self._serve(reader, writer)

    def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
               ) -> Coroutine[Any, Any, None]:
        """The coroutine running one counted connection (on_connections(1) already
        said) to its end; the connection tells _ended when it is over.

        A plain function: the connection's own run() is the task's outermost
        frame, one frame fewer held by every open connection.
        """
        slim_drain_waiters(writer.transport.get_protocol())
        read_in_heap_sized_pieces(writer.transport)
        connection = ClientConnection(reader, writer, self.handler, self.limits,
                                      self._is_draining, self._ended)
        self.connections.add(connection)
        return connection.run()

    def _ended(self, connection: ClientConnection) -> None:
        self.connections.discard(connection)
        if self._on_connections:
            self._on_connections(-1)

    # -- TLS: accepted plain, counted, then handshaken under a bound

    async def _listen_tls(self, host: str | None, port: int, reuse_port: bool,
                          sock: socket.socket | None, context: ssl_module.SSLContext) -> None:
        if sock is None:
            sock = await _bound_socket(host, port, reuse_port)
        sock.setblocking(False)
        self._tls_context = context
        self._tls_sockets.append(sock)
        loop = asyncio.get_running_loop()
        self._tls_accepting.append(loop.create_task(self._accept_tls(sock)))

    async def _accept_tls(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        failing = False  # one warning per run of failed accepts, not ten a second
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if sock.fileno() < 0:
                    return  # closed: stop_accepting
                if not failing:
                    log.warning("accept failed (%s); retrying every %gs", exc,
                                ACCEPT_RETRY_SECONDS)
                failing = True
                await asyncio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            failing = False
            if self._full() or self.draining:
                conn.close()  # no TLS yet: nothing a client could read; it sees the close
                continue
            self.handshaking += 1
            if self._on_connections:
                self._on_connections(1)
            task = loop.create_task(self._tls_connection(conn))
            self._tls_connections.add(task)
            task.add_done_callback(self._tls_connections.discard)

    async def _tls_connection(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=READ_SIZE, loop=loop)
        handshaken = False
        me = asyncio.current_task()
        assert me is not None and self._tls_context is not None
        self._handshakes.add(me)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: asyncio.StreamReaderProtocol(reader, loop=loop), conn,
                ssl=self._tls_context, ssl_handshake_timeout=self.limits.tls_handshake_timeout)
            handshaken = True
        except (OSError, asyncio.TimeoutError):
            pass  # a failed, refused or stalled handshake: the transport closed the socket
        finally:
            self.handshaking -= 1
            self._handshakes.discard(me)
            if not handshaken:
                conn.close()  # cancelled or failed: no fd outlives the attempt
                if self._on_connections:
                    self._on_connections(-1)
        if handshaken:
            # The transport's own protocol, not what connect_accepted_socket
            # returned: under uvloop that is its internal SSLProtocol, which has
            # no _drain_helper (every drain, so every keep-alive answer, failed).
            writer = asyncio.StreamWriter(transport, transport.get_protocol(), reader, loop)
            await self._serve(reader, writer)

    def stop_accepting(self) -> None:
        for server in self._servers:
            server.close()
        for task in self._tls_accepting:
            task.cancel()
        self._tls_accepting.clear()
        for sock in self._tls_sockets:
            sock.close()

    async def drain(self, seconds: float) -> int:
        """Stop accepting; let requests in flight finish for ``seconds``; close the rest.

        Idle keep-alive connections stay open while requests are in flight, so a
        client (or a probe) on one can still be told we are draining: every
        response now carries ``connection: close``, and the handler may refuse
        new work. Once nothing is in flight, or at the deadline, all close.
        Returns how many requests the deadline cut.
        """
        self.draining = True
        self.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while any(c.busy for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = 0
        for connection in list(self.connections):
            if connection.busy:
                cut += 1
                connection.abort()
            else:
                connection.close()
        handshakes = list(self._handshakes)
        for task in handshakes:
            task.cancel()  # still handshaking: never a ClientConnection to close
        if handshakes:
            await asyncio.wait(handshakes, timeout=1.0)
        for server in self._servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 1.0)
            except asyncio.TimeoutError:  # pragma: no cover
                pass
        return cut


async def _bound_socket(host: str | None, port: int, reuse_port: bool) -> socket.socket:
    """A listening socket on host:port, as asyncio.start_server would bind it."""
    loop = asyncio.get_running_loop()
    family, kind, proto, _, address = (await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock
