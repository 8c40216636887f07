"""Upstream HTTP/1.1: httpcore connections in a pool per endpoint, lowproxy's cycle on them.

Each endpoint keeps its own idle connections. A connection goes back to the
pool only when both sides of its h11 state are DONE and nothing came past the
response; anything else (a response read partly because the client left, an
error, stray bytes) closes it. Pooled connections retire after
``upstream_max_requests`` requests or ``upstream_max_age`` seconds, because
kube-proxy balances connections, not requests: a connection that lived for
ever would pin its share of traffic to one pod. A rotated CA file retires
connections made under the old trust.

httpcore owns each connection (httpcore_internals.py: it is built over our
asyncio-native stream, stream.py, and keeps the h11 state); the request/
response cycle on it is cycle.py's, and this module owns reuse,
retirement and balancing, which httpcore's pool cannot express.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

import h11
import httpcore

from ..config.settings import Config
from ..h11_internals import start_next_cycle
from ..headers import body_framing
from ..tls import TrustStore, TrustUnavailable
from .chunked import ChunkedError, ChunkedRelay, Deliver
from .cycle import (
    BodyError,
    HeadError,
    HeadReader,
    Informational,
    LengthRelay,
    finish_chunked,
    request_bytes,
)
from .endpoint import Endpoint, PooledConnection
from .errors import (
    UpstreamClosed,
    UpstreamError,
    UpstreamNotRetried,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
    UpstreamUntrusted,
)
from .httpcore_internals import adopt
from .stream import AsyncioBackend

__all__ = ["Endpoint", "Upstream", "UpstreamResponse", "UpstreamError", "UpstreamClosed",
           "UpstreamNotRetried", "UpstreamProtocolError", "UpstreamTimeout",
           "UpstreamUnreachable", "UpstreamUntrusted", "Informational", "system_resolver"]

log = logging.getLogger("lowproxy.upstream")

# Idle connections kept per endpoint; more than this are closed on release.
MAX_IDLE_PER_ENDPOINT = 256
# Requests a proxy may send again after a reused connection failed under them:
# the methods Go's transport replays (RFC 9110 section 9.2.2), and any request
# carrying an idempotency key (draft-ietf-httpapi-idempotency-key-header).
REPLAYABLE_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})
IDEMPOTENCY_HEADERS = frozenset({b"idempotency-key", b"x-idempotency-key"})
_DONE = h11.DONE
_NOTHING_TRAILING = (b"", False)


class UpstreamResponse:
    """A backend's response: status and headers now, the body as it arrives.

    Always end it with ``aclose()``: idempotent, and it never suspends, so it
    completes even in the ``finally`` of a cancelled task. The connection
    returns to the pool only if the body was read to its end, and nothing
    came after it.
    """

    __slots__ = ("status", "headers", "endpoint", "_pooled", "_head", "_upstream",
                 "_complete", "_closed", "_chunked")

    def __init__(self, upstream: Upstream, endpoint: Endpoint, pooled: PooledConnection,
                 head: HeadReader, method: bytes) -> None:
        response, head.response = head.response, None  # a long stream keeps no h11 event
        assert response is not None, "made once the final head is in"
        self.status = status = response.status_code
        headers: list[tuple[bytes, bytes]] = response.headers.raw_items()
        self.endpoint = endpoint
        self._upstream = upstream
        self._pooled = pooled
        self._head: HeadReader | None = head
        self._complete = False
        self._closed = False
        _, framed_by_te = body_framing(headers)
        if framed_by_te:
            # A length beside Transfer-Encoding describes nothing (body_framing)
            # and must not reach anyone who might frame the relayed body by it.
            headers = [(n, v) for n, v in headers if n.lower() != b"content-length"]
        self.headers = headers
        # A chunked body (a stream) is decoded by ChunkedRelay, not by h11.
        self._chunked = (framed_by_te and method != b"HEAD" and status >= 200
                         and status not in (204, 304))

    async def deliver_body(self, deliver: Deliver,
                           wait_for_consumer: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to ``deliver`` as it arrives: de-chunked, never decompressed.

        ``deliver(pieces)`` gets the pieces one network read brought and answers
        whether its consumer is slow; then reading pauses until
        ``wait_for_consumer()`` returns (back-pressure). The pieces are handed
        over in the connection's data_received: a token costs no task wake-up.
        Raises UpstreamError when the backend breaks off, or whatever
        ``deliver`` raised.
        """
        pooled, head = self._pooled, self._head
        assert head is not None, "the body is delivered once"
        self._head = None  # nothing of the head is kept while the body streams
        stream = pooled.stream
        if stream is None:
            raise UpstreamProtocolError(f"{self.endpoint.label}: the connection was closed",
                                        self.endpoint)
        relay: ChunkedRelay | LengthRelay
        if self._chunked:
            relay = ChunkedRelay(stream, deliver)
        else:
            relay = LengthRelay(pooled.h11, stream, deliver)
        stream.set_sink(relay)
        try:
            if head.rest:  # usually the whole body, read with the head
                pending, head.rest = head.rest, b""
                relay.data_received(pending)
            elif not self._chunked:
                relay.start()  # type: ignore[union-attr]
            if head.eof is not False:
                relay.connection_closed(head.eof if head.eof is not True else None)
            # Nor in this frame: the head reader keeps the head's bytes and event,
            # which a stream lasting minutes would hold to its end.
            del head
            stream.resume_reading()  # the head reader may have paused it
            while relay.error is None and not relay.done:
                if relay.slow:
                    relay.slow = False
                    await wait_for_consumer()
                    stream.resume_reading()
                else:
                    await relay.wait()
        finally:
            stream.detach()
        if relay.error is not None:
            error = relay.error
            if isinstance(error, (ChunkedError, BodyError)):
                raise UpstreamProtocolError(f"{self.endpoint.label} broke off its response: "
                                            f"{error}", self.endpoint) from None
            raise error
        if relay.stray or (self._chunked and relay.decoder.leftover):  # type: ignore
            return  # bytes after the body: delivered whole, but the connection retires
        if self._chunked:
            finish_chunked(pooled.h11)
        self._complete = True

    async def read(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes and ``limit`` / 256 pieces (at
        least 4096; more is a protocol error: a health answer of 2-byte chunks
        kept the event loop decoding for seconds every round)."""
        parts: list[bytes] = []
        size = count = 0
        most_pieces = max(4096, limit // 256)

        def collect(pieces: list[bytes]) -> bool:
            nonlocal size, count
            parts.extend(pieces)
            size += sum(len(piece) for piece in pieces)
            count += len(pieces)
            if size > limit or count > most_pieces:
                raise UpstreamProtocolError(f"{self.endpoint.label} answered more than "
                                            f"{limit} bytes or {most_pieces} chunks",
                                            self.endpoint)
            return False

        await self.deliver_body(collect, _never_waits)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read_prefix(self, limit: int, most: int, most_pieces: int = 1 << 16) -> bytes:
        """The body's first ``limit`` bytes; the rest is read and let go (the
        connection stays good), up to ``most`` bytes in all and ``most_pieces``
        chunks more than ``limit`` / 16 (more is a protocol error: a body of
        1-byte chunks would otherwise keep the event loop decoding chunks for the
        whole leg's bound; counted past the kept part only, the 8M of a kept
        8 MiB held it 4.7 s; an answer of 70,000 10-byte chunks is still one)."""
        kept = bytearray()  # not a list of pieces: tiny chunks would cost 50x their size
        size = count = 0
        most_pieces += limit // 16

        def collect(pieces: list[bytes]) -> bool:
            nonlocal size, count
            count += len(pieces)
            for piece in pieces:
                if size < limit:
                    kept.extend(piece[:limit - size])
                size += len(piece)
            if size > most or count > most_pieces:
                raise UpstreamProtocolError(
                    f"{self.endpoint.label} answered more than {most} bytes or "
                    f"{most_pieces} chunks", self.endpoint)
            return False

        await self.deliver_body(collect, _never_waits)
        return bytes(kept)

    async def aclose(self) -> None:
        if self._closed:
            return
        if not self._complete:
            self.abandon()
            return
        self._closed = True
        self._upstream._finish(self.endpoint, self._pooled)

    def abandon(self) -> None:
        """Close the connection now, unread: for responses that will not be relayed."""
        if self._closed:
            return
        self._closed = True
        self.endpoint.in_flight -= 1
        self._upstream._discard(self.endpoint, self._pooled)


async def _never_waits() -> None:  # pragma: no cover - collect() is never slow
    return None


Resolver = Callable[[str, int], Awaitable[list[str]]]


class Upstream:
    """Opens, reuses and retires upstream connections; owns every endpoint's pool."""

    def __init__(self, config: Config, trust: TrustStore) -> None:
        self.config = config
        self.trust = trust
        self.backend = AsyncioBackend()

    # -- one exchange

    async def request(self, endpoint: Endpoint, method: bytes, target: bytes,
                      headers: list[tuple[bytes, bytes]], body: bytes | None, *,
                      extra_headers: Iterable[tuple[bytes, bytes]] = (),
                      on_informational: Informational | None = None,
                      while_waiting: Callable[[], None] | None = None) -> UpstreamResponse:
        """Send one request and return once the final response's head has arrived.

        ``headers`` are the end-to-end ones; host and framing are added here.
        ``on_informational(status, headers)`` is called for each 1xx but 101
        before the final head (synchronously; what it raises ends the exchange).
        ``while_waiting()`` is called once the request is sent, before the wait
        for the head: work the caller needs after the answer, done while the
        backend computes it (it must not raise; it may be called more than once:
        on a retry, and before a new connection is dialled, a wait too, so that
        what the work lets go of is not held through a connect storm).

        A reused connection that the backend closed under the request (its
        keep-alive ran out as we wrote) is replaced by a fresh one, once, only
        when none of the request was handed to it or the request is replayable
        (REPLAYABLE_METHODS, an idempotency key): otherwise the backend may have
        acted on it, and UpstreamNotRetried says so.
        """
        wire_headers = [(b"host", endpoint.host_header), *headers, *extra_headers]
        if body is not None:
            wire_headers.append((b"content-length", b"%d" % len(body)))
        target = endpoint.base_path + target if endpoint.base_path else target
        endpoint.in_flight += 1
        try:
            pooled = self._checkout(endpoint)
            if pooled is not None:
                try:
                    return await self._send(endpoint, pooled, method, target, wire_headers,
                                            body, on_informational, while_waiting)
                except UpstreamClosed as exc:
                    if exc.request_sent and not _replayable(method, wire_headers):
                        raise UpstreamNotRetried(
                            f"{endpoint.label} closed the connection after the request was "
                            f"sent, before answering; not retried: "
                            f"{method.decode('ascii', 'replace')} is not idempotent and has no "
                            "idempotency-key", endpoint) from None
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("retrying on a new connection: %s", exc.detail)
            if while_waiting is not None:
                while_waiting()
            pooled = await self._connect(endpoint)
            return await self._send(endpoint, pooled, method, target, wire_headers, body,
                                    on_informational, while_waiting)
        except BaseException:
            endpoint.in_flight -= 1
            raise

    async def _send(self, endpoint: Endpoint, pooled: PooledConnection, method: bytes,
                    target: bytes, headers: list[tuple[bytes, bytes]], body: bytes | None,
                    on_informational: Informational | None,
                    while_waiting: Callable[[], None] | None = None) -> UpstreamResponse:
        """One request on one connection, up to the final head; closes it on failure."""
        stream = pooled.stream
        assert stream is not None, "a connection in use is open"
        pooled.requests += 1
        head = HeadReader(pooled.h11, stream, on_informational)
        received = stream.bytes_received
        try:
            pending = stream.attach(head)  # the idle watch, if any, ends here
            if pending:
                head.data_received(pending)
            if not stream.send_now(request_bytes(pooled.h11, method, target, headers, body)):
                raise UpstreamClosed(f"{endpoint.label} closed the connection before the "
                                     "request, before answering", endpoint, request_sent=False)
            if not head.done:
                if while_waiting is not None:
                    while_waiting()
                await head.wait()
            if not head.final:
                error = head.error
                if error is None:  # the backend hung up before its head was whole
                    cause = head.eof if head.eof is not True else "connection closed"
                    if stream.bytes_received == received:
                        raise UpstreamClosed(
                            f"{endpoint.label} closed the connection after the request was "
                            f"sent, before answering: {cause}", endpoint, request_sent=True)
                    raise UpstreamProtocolError(f"{endpoint.label} broke off its response "
                                                f"head: {cause}", endpoint)
                if isinstance(error, HeadError):
                    raise UpstreamProtocolError(f"{endpoint.label}: {error}", endpoint)
                raise error
        except BaseException:
            self._discard(endpoint, pooled)
            raise
        return UpstreamResponse(self, endpoint, pooled, head, method)

    # -- the pool

    def _checkout(self, endpoint: Endpoint) -> PooledConnection | None:
        if not endpoint.idle:
            return None
        generation = self.trust.current_generation() if endpoint.tls else 0
        now = time.monotonic()
        config = self.config
        while endpoint.idle:
            pooled = endpoint.idle.pop()
            stream = pooled.stream
            if (stream is None or now - pooled.created >= config.upstream_max_age
                    or now - pooled.idle_since >= config.upstream_idle
                    or pooled.generation != generation or stream.readable_now()):
                self._discard(endpoint, pooled)
                continue
            return pooled
        return None

    async def _connect(self, endpoint: Endpoint) -> PooledConnection:
        ssl_context = None
        generation = 0
        if endpoint.tls:
            try:
                ssl_context = self.trust.context()
            except TrustUnavailable as exc:
                raise UpstreamUntrusted(str(exc), endpoint) from None
            generation = self.trust.generation
        try:
            stream = await self.backend.connect_tcp(
                endpoint.connect_host, endpoint.port, timeout=self.config.connect_timeout,
                ssl_context=ssl_context, server_hostname=endpoint.server_hostname)
        except (httpcore.ConnectTimeout, httpcore.ConnectError) as exc:
            raise UpstreamUnreachable(str(exc), endpoint) from None
        http, h11_state = adopt(endpoint.origin, stream, self.config.upstream_idle)
        endpoint.open += 1
        return PooledConnection(http, stream, h11_state, generation,
                       functools.partial(self._drop_idle, endpoint))

    def _finish(self, endpoint: Endpoint, pooled: PooledConnection) -> None:
        """A response read to its end: pool its connection, or retire it. Never suspends."""
        endpoint.in_flight -= 1
        config = self.config
        stream = pooled.stream
        state = pooled.h11
        if (stream is not None and config.upstream_keepalive
                and state.our_state is _DONE and state.their_state is _DONE
                # h11 holds nothing past the response (a length-framed body
                # read with more behind it in the same segment) ...
                and state.trailing_data == _NOTHING_TRAILING
                # ... and the request has left in full (Go's transport, too,
                # reuses a connection only once its request was written).
                and (not stream.sent_large or stream.all_sent)
                and pooled.requests < config.upstream_max_requests
                and len(endpoint.idle) < MAX_IDLE_PER_ENDPOINT
                and not endpoint.removed):
            now = time.monotonic()
            # ... and nothing came after it. From now on, anything that comes
            # (stray bytes it owes nobody, its keep-alive FIN, a reset) drops
            # the connection as it arrives: stray bytes are never read as the
            # next answer (RFC 9112 section 9.3), and a close seen now is not a
            # request lost later.
            if (now - pooled.created < config.upstream_max_age
                    and stream.watch_idle(pooled.on_idle_event, pooled)):
                start_next_cycle(state)
                pooled.idle_since = now
                endpoint.idle.append(pooled)
                return
        self._discard(endpoint, pooled)

    def _discard(self, endpoint: Endpoint, pooled: PooledConnection) -> None:
        if pooled.stream is None:
            return
        pooled.stream.close()
        pooled.stream = None
        endpoint.open -= 1

    def _drop_idle(self, endpoint: Endpoint, pooled: PooledConnection) -> None:
        """A pooled connection heard from while idle (see _finish)."""
        try:
            endpoint.idle.remove(pooled)
        except ValueError:
            pass  # already checked out, swept or closed
        else:
            self._discard(endpoint, pooled)

    def sweep(self, endpoints: Iterable[Endpoint]) -> None:
        """Close idle connections past their idle time or age (closes by the peer
        are dropped as they arrive, by the idle watch)."""
        now = time.monotonic()
        config = self.config
        for endpoint in endpoints:
            keep = []
            for pooled in endpoint.idle:
                if (now - pooled.idle_since >= config.upstream_idle
                        or now - pooled.created >= config.upstream_max_age):
                    self._discard(endpoint, pooled)
                else:
                    keep.append(pooled)
            endpoint.idle[:] = keep

    def close_idle(self, endpoint: Endpoint) -> None:
        for pooled in endpoint.idle:
            self._discard(endpoint, pooled)
        endpoint.idle.clear()


def _replayable(method: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request may be sent again after a reused connection failed under it."""
    return method in REPLAYABLE_METHODS or any(
        name.lower() in IDEMPOTENCY_HEADERS for name, _ in headers)


async def system_resolver(host: str, port: int) -> list[str]:
    """All addresses of a name, as a headless Kubernetes Service publishes its pods."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: dict[str, None] = {}
    for info in infos:
        seen.setdefault(str(info[4][0]), None)
    return list(seen)
