"""What lowproxy puts under httpcore's HTTP/1.1 connection: an asyncio-native stream.

httpcore's default asyncio path goes through anyio's socket streams, which cost
several event-loop round trips per read. This stream is a plain
``asyncio.Protocol`` with a small buffer: ``read`` returns what has arrived,
and reading pauses when the buffer passes a high-water mark, so a consumer that
stops reading (a slow client downstream) pushes back on the backend through
TCP instead of growing memory.

httpcore's HTTP/1.1 connection is built over such a stream
(httpcore_internals.py), and lowproxy's request/response cycle runs on it
(cycle.py): the cycle's parsers are the stream's sink, called from
data_received, so a response in one segment costs no read call and no wake-up
but the one that hands over the whole head.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
from collections.abc import Callable
from typing import Any

import httpcore

from ..asyncio_internals import read_in_heap_sized_pieces, release_closed_transport
from ..timeouts import deadline

# Stop reading from the socket past this much unread data (back-pressure).
READ_HIGH_WATER = 64 * 1024
# Writes smaller than this wait for the next one or for the first read.
LARGE_WRITE = 16384  # see AsyncioStream.all_sent
WRITE_COALESCE = 64 * 1024


class _StreamProtocol(asyncio.Protocol):
    __slots__ = ("transport", "chunks", "size", "eof", "error", "reader", "writer",
                 "reading_paused", "writing_paused", "loop", "sink", "received")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.eof = False
        self.error: BaseException | None = None
        self.reader: asyncio.Future[None] | None = None
        self.writer: asyncio.Future[None] | None = None
        self.reading_paused = False
        self.writing_paused = False
        # While a body is relayed straight from this connection (see
        # AsyncioStream.attach), arriving bytes go to the sink, not the buffer.
        self.sink: Any = None
        # Bytes that ever arrived: whether a failed exchange saw any answer at all.
        self.received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        read_in_heap_sized_pieces(transport)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.sink is not None:
            self.sink.data_received(data)
            return
        self.chunks.append(data)
        self.size += len(data)
        if self.size > READ_HIGH_WATER and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        if self.sink is not None:
            self.sink.connection_closed(None)
        self._wake_reader()
        return False  # close our side too: HTTP/1.1 has no use for half-open

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        release_closed_transport(self.transport)
        if self.sink is not None:
            self.sink.connection_closed(exc)
        self._wake_reader()
        writer, self.writer = self.writer, None
        if writer is not None and not writer.done():
            writer.set_result(None)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        writer, self.writer = self.writer, None
        if writer is not None and not writer.done():
            writer.set_result(None)

    def _wake_reader(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None and not reader.done():
            reader.set_result(None)


class _IdleWatch:
    """The sink of an idle connection (see AsyncioStream.watch_idle)."""

    __slots__ = ("on_event", "subject")

    def __init__(self, on_event: Callable[[Any], None], subject: Any) -> None:
        self.on_event = on_event
        self.subject = subject

    def data_received(self, data: bytes) -> None:
        self.on_event(self.subject)

    def connection_closed(self, exc: BaseException | None) -> None:
        self.on_event(self.subject)


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class AsyncioStream(httpcore.AsyncNetworkStream):
    """httpcore's network stream interface over one asyncio transport."""

    __slots__ = ("_protocol", "_transport", "_unsent", "_fd", "bytes_sent", "sent_large")

    def __init__(self, protocol: _StreamProtocol) -> None:
        self._protocol = protocol
        transport = protocol.transport
        assert transport is not None, "a stream is made once the connection is"
        self._transport: asyncio.Transport = transport
        # httpcore writes a request's head and body separately; both go out in
        # one segment when the response is first read. On loopback every send
        # also runs the peer's receive path, so a write saved is CPU saved.
        self._unsent: list[bytes] = []
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1  # for readable_now()
        # Bytes handed to the transport, over the connection's life. Writes wait
        # in _unsent until the first read, so this, not httpcore's write calls,
        # says whether a request can have reached the backend.
        self.bytes_sent = 0
        # A write of LARGE_WRITE bytes or more was made and not yet seen all sent
        # (all_sent): only then can the transport still hold part of a request.
        self.sent_large = False

    async def _wait(self, attr: str, timeout: float | None) -> None:
        protocol = self._protocol
        future = protocol.loop.create_future()
        setattr(protocol, attr, future)
        if timeout is None:
            await future
            return
        timer = protocol.loop.call_later(timeout, _expire, future)
        try:
            await future
        finally:
            timer.cancel()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._protocol.loop

    @property
    def at_eof(self) -> bool:
        return self._protocol.eof

    @property
    def all_sent(self) -> bool:
        """Every byte written has left the transport: a backend that answered before
        reading the whole request (an early 413) leaves the rest queued, and the next
        request on this connection would wait behind it for ever. Asked only after
        a large write (``sent_large``): a smaller one goes into the socket's send
        buffer whole (Linux gives it at least 16 KiB), so the common request pays
        nothing for the check."""
        if self._unsent or self._transport.get_write_buffer_size():
            return False
        self.sent_large = False
        return True

    @property
    def bytes_received(self) -> int:
        return self._protocol.received

    def attach(self, sink: Any) -> bytes:
        """Send arriving bytes to ``sink`` (its data_received and connection_closed)
        instead of buffering them; return what was already buffered."""
        protocol = self._protocol
        if self._unsent:
            self._send_unsent()
        pending = b"".join(protocol.chunks)
        protocol.chunks.clear()
        protocol.size = 0
        protocol.sink = sink
        self.resume_reading()
        return pending

    def detach(self) -> None:
        self._protocol.sink = None

    def set_sink(self, sink: Any) -> None:
        """Hand arriving bytes to another sink; what is buffered stays buffered."""
        self._protocol.sink = sink

    def send_now(self, data: bytes) -> bool:
        """One write, now (a whole request: nothing to coalesce it with).

        False, with nothing sent, when the backend already hung up: the
        request is then known not to have reached it.
        """
        if self._unsent:
            self._send_unsent()
        if self._protocol.eof or self._transport.is_closing():
            return False
        self.bytes_sent += len(data)
        self._transport.write(data)
        if len(data) >= LARGE_WRITE:
            self.sent_large = True
        return True

    def readable_now(self) -> bool:
        """Whether anything came: buffered, EOF, or in the kernel not yet handed over.

        For a pooled connection at checkout: whatever an idle HTTP/1.1
        connection receives means the server closed it or wrote past its
        answer, and the loop may not have run its callback yet.
        """
        protocol = self._protocol
        return (protocol.eof or bool(protocol.chunks) or self._transport.is_closing()
                or self._socket_readable())

    def watch_idle(self, on_event: Callable[[Any], None], subject: Any) -> bool:
        """Call ``on_event(subject)`` once anything comes (bytes, EOF, a reset); until
        the next attach() or close().

        For a connection idle between requests, where anything from the peer
        means the connection is done for. False, with no watch set, when
        something already came.
        """
        if self._protocol.eof or self._protocol.chunks:
            return False
        self.attach(_IdleWatch(on_event, subject))
        return True

    def pause_reading(self) -> None:
        protocol = self._protocol
        if not protocol.reading_paused and not protocol.eof:
            protocol.reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        protocol = self._protocol
        if protocol.reading_paused and not protocol.eof:
            protocol.reading_paused = False
            self._transport.resume_reading()

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        protocol = self._protocol
        if self._unsent:
            self._send_unsent()
        if not protocol.chunks:
            if protocol.eof:
                return b""
            try:
                await self._wait("reader", timeout)
            except TimeoutError:
                raise httpcore.ReadTimeout("timed out reading from upstream") from None
            if not protocol.chunks:
                return b""
        chunks = protocol.chunks
        if len(chunks) == 1 and len(chunks[0]) <= max_bytes:
            data = chunks[0]
            chunks.clear()
        else:
            joined = b"".join(chunks)
            data, rest = joined[:max_bytes], joined[max_bytes:]
            chunks.clear()
            if rest:
                chunks.append(rest)
        protocol.size -= len(data)
        if protocol.reading_paused and protocol.size <= READ_HIGH_WATER // 4:
            protocol.reading_paused = False
            if not protocol.eof:
                self._transport.resume_reading()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        protocol = self._protocol
        if protocol.eof or self._transport.is_closing():
            raise httpcore.WriteError("upstream connection closed")
        self._unsent.append(buffer)
        if len(buffer) < WRITE_COALESCE:
            return
        self._send_unsent()
        if protocol.writing_paused:
            try:
                await self._wait("writer", timeout)
            except TimeoutError:
                raise httpcore.WriteTimeout("timed out writing to upstream") from None

    def _send_unsent(self) -> None:
        unsent = self._unsent
        data = unsent[0] if len(unsent) == 1 else b"".join(unsent)
        unsent.clear()
        if self._protocol.eof or self._transport.is_closing():
            # The backend hung up before these bytes left: they are dropped,
            # never sent, so the request is known not to have reached it.
            return
        self.bytes_sent += len(data)
        self._transport.write(data)
        if len(data) >= LARGE_WRITE:
            self.sent_large = True

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close at once, without waiting (safe in a cancelled task or a finally)."""
        if isinstance(self._protocol.sink, _IdleWatch):
            self._protocol.sink = None  # its owner is closing it: no call back
        transport = self._transport
        if not transport.is_closing():
            # abort(): an unfinished response must not be drained, and a decode
            # server aborts the request when its connection drops.
            transport.abort()

    def _socket_readable(self) -> bool:
        """Whether the kernel holds input (or EOF) for this socket; never blocks.

        poll(), not select(): select() fails for descriptors of 1024 and above.
        """
        if self._fd < 0:
            return False
        try:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # closed meanwhile: unusable, so "readable"
            return True

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            # Data or EOF on an idle HTTP/1.1 connection means the server closed it
            # or wrote past its answer. Our buffers first; then the socket itself:
            # bytes in the kernel that the loop has not handed over yet count too.
            return self._protocol.eof or bool(self._protocol.chunks) or self._socket_readable()
        if info == "ssl_object":
            return self._transport.get_extra_info("ssl_object")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "socket":
            return self._transport.get_extra_info("socket")
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """Opens AsyncioStreams; TLS is negotiated in the same call when a context is given."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> AsyncioStream:
        loop = asyncio.get_running_loop()
        protocol = _StreamProtocol(loop)
        connecting = loop.create_connection(
            lambda: protocol, host, port,
            ssl=ssl_context,
            server_hostname=server_hostname if ssl_context is not None else None,
            local_addr=(local_address, 0) if local_address else None,
            family=socket.AF_UNSPEC,
        )
        try:
            async with deadline(timeout):
                await connecting
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except ssl.SSLError as exc:
            raise httpcore.ConnectError(f"TLS with {host}:{port} failed: {exc}") from None
        except UnicodeError:  # a name getaddrinfo cannot encode (parse_endpoint refuses them)
            raise httpcore.ConnectError(f"connect to {host}:{port} failed: not a valid host "
                                        "name") from None
        except OSError as exc:
            raise httpcore.ConnectError(
                f"connect to {host}:{port} failed: "
                f"{exc.strerror or str(exc) or type(exc).__name__}") from None
        return AsyncioStream(protocol)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
