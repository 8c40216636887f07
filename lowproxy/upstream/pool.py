"""Upstream HTTP/1.1: httpcore connections in a pool per endpoint.

Each endpoint keeps its own idle connections. A connection goes back to the
pool only when httpcore has seen both sides of its exchange DONE; anything else
(a response read partly because the client left, an error) closes it. Pooled
connections retire after ``upstream_max_requests`` requests or
``upstream_max_age`` seconds, because kube-proxy balances connections, not
requests: a connection that lived for ever would pin its share of traffic to
one pod. A rotated CA file retires connections made under the old trust.

httpcore is used below its pool: ``AsyncHTTP11Connection`` does the HTTP/1.1
exchange over our asyncio-native stream (stream.py), and this module owns
reuse, retirement and balancing, which httpcore's pool cannot express.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Protocol, cast

import httpcore

from ..config.settings import Config
from ..headers import body_framing
from ..tls import TrustStore, TrustUnavailable
from .chunked import ChunkedError, ChunkedRelay, Deliver
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
from .stream import AsyncioBackend, AsyncioStream, Informational, http11_connection

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

_SENT: tuple[bytes, ...] = ()  # an empty body, for requests already sent


class _BodyStream(Protocol):
    """What httpcore's HTTP11ConnectionByteStream offers (response.stream)."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class UpstreamResponse:
    """A backend's response: status and headers now, the body as it arrives.

    Always end it with ``aclose()``: idempotent, and it never suspends, so it
    completes even in the ``finally`` of a cancelled task. The connection
    returns to the pool only if the body was read to its end, and nothing
    came after it.
    """

    __slots__ = ("status", "headers", "endpoint", "_pooled", "_body", "_upstream",
                 "_complete", "_closed", "_chunked")

    def __init__(self, upstream: Upstream, endpoint: Endpoint, pooled: PooledConnection,
                 response: httpcore.Response, method: bytes) -> None:
        self.status = response.status
        headers: list[tuple[bytes, bytes]] = response.headers
        self.endpoint = endpoint
        self._upstream = upstream
        self._pooled = pooled
        self._body = cast(_BodyStream, response.stream)
        self._complete = False
        self._closed = False
        _, framed_by_te = body_framing(headers)
        if framed_by_te:
            # A length beside Transfer-Encoding describes nothing (body_framing)
            # and must not reach anyone who might frame the relayed body by it.
            headers = [(n, v) for n, v in headers if n.lower() != b"content-length"]
        self.headers = headers
        # A chunked body (a stream) is decoded here, not by h11: see _relay_chunked.
        self._chunked = (framed_by_te and method != b"HEAD" and self.status >= 200
                         and self.status not in (204, 304))

    async def deliver_body(self, deliver: Deliver,
                           wait_for_consumer: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to ``deliver`` as it arrives: de-chunked, never decompressed.

        ``deliver(pieces)`` gets the pieces one network read brought and answers
        whether its consumer is slow; then reading pauses until
        ``wait_for_consumer()`` returns (back-pressure). Raises UpstreamError when
        the backend breaks off, or whatever ``deliver`` raised.
        """
        label = self.endpoint.label
        try:
            if self._chunked and self._pooled.stream is not None:
                await self._relay_chunked(self._pooled.stream, deliver, wait_for_consumer)
                return
            async for chunk in self._body:
                if deliver([chunk]):
                    await wait_for_consumer()
        except httpcore.TimeoutException as exc:
            raise UpstreamTimeout(f"reading from {label}: {exc}", self.endpoint) from None
        except (httpcore.NetworkError, httpcore.ProtocolError, ChunkedError) as exc:
            raise UpstreamProtocolError(f"{label} broke off its response: "
                                        f"{exc or type(exc).__name__}", self.endpoint) from None
        self._complete = True

    async def _relay_chunked(self, stream: AsyncioStream, deliver: Deliver,
                             wait_for_consumer: Callable[[], Awaitable[None]]) -> None:
        """A chunked body (a stream), decoded and delivered as each read arrives.

        The decoding runs in the connection's data_received callback: a token
        that arrives costs a find, a slice and one write to the client, with no
        task to wake. h11 saw only the head (the stream was head_only); once the
        last chunk is in, it is handed the bare terminating chunk and completes
        the exchange as if it had read the body itself, so the connection pools
        as usual.
        """
        relay = ChunkedRelay(stream, deliver)
        pending = stream.attach(relay)
        try:
            if pending:
                relay.data_received(pending)
            if stream.at_eof:
                relay.connection_closed(None)
            while relay.error is None and not relay.decoder.done:
                if relay.slow:
                    relay.slow = False
                    await wait_for_consumer()
                    stream.resume_reading()
                else:
                    await relay.wait()
        finally:
            stream.detach()
        if relay.error is not None:
            raise relay.error
        if relay.decoder.leftover or relay.stray:
            return  # bytes after the body: delivered whole, but the connection retires
        stream.inject(b"0\r\n\r\n")
        async for _ in self._body:
            raise httpcore.RemoteProtocolError("h11 saw body data after the head")
        self._complete = True

    async def read(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes (more is a protocol error)."""
        parts: list[bytes] = []
        size = 0

        def collect(pieces: list[bytes]) -> bool:
            nonlocal size
            parts.extend(pieces)
            size += sum(len(piece) for piece in pieces)
            if size > limit:
                raise UpstreamProtocolError(f"{self.endpoint.label} answered more than "
                                            f"{limit} bytes", self.endpoint)
            return False

        await self.deliver_body(collect, _never_waits)
        return b"".join(parts)

    async def aclose(self) -> None:
        if self._closed:
            return
        if not self._complete:
            self.abandon()
            return
        self._closed = True
        await self._upstream._finish(self.endpoint, self._pooled, self._body)

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
                      on_informational: Informational | None = None) -> UpstreamResponse:
        """Send one request and return once the final response's head has arrived.

        ``headers`` are the end-to-end ones; host and framing are added here.
        ``on_informational(status, headers)`` is called for each 1xx but 101
        before the final head (synchronously; what it raises ends the exchange).

        A reused connection that the backend closed under the request (its
        keep-alive ran out as we wrote) is replaced by a fresh one, once, only
        when none of the request was handed to it or the request is replayable
        (REPLAYABLE_METHODS, an idempotency key): otherwise the backend may have
        acted on it, and UpstreamNotRetried says so.
        """
        wire_headers = [(b"host", endpoint.host_header)]
        wire_headers.extend(headers)
        wire_headers.extend(extra_headers)
        if body is not None:
            wire_headers.append((b"content-length", str(len(body)).encode()))
        url = httpcore.URL(scheme=endpoint.origin.scheme, host=endpoint.origin.host,
                           port=endpoint.port, target=endpoint.base_path + target)
        request = httpcore.Request(method, url, headers=wire_headers,
                                   content=body if body is not None else b"")
        endpoint.in_flight += 1
        try:
            pooled = self._checkout(endpoint)
            if pooled is not None:
                try:
                    return await self._send(endpoint, pooled, request, on_informational)
                except UpstreamClosed as exc:
                    if exc.request_sent and not _replayable(method, wire_headers):
                        raise UpstreamNotRetried(
                            f"{endpoint.label} closed the connection after the request was "
                            f"sent, before answering; not retried: "
                            f"{method.decode('ascii', 'replace')} is not idempotent and has no "
                            "idempotency-key", endpoint) from None
                    log.debug("retrying on a new connection: %s", exc.detail)
            pooled = await self._connect(endpoint)
            return await self._send(endpoint, pooled, request, on_informational)
        except BaseException:
            endpoint.in_flight -= 1
            raise

    async def _send(self, endpoint: Endpoint, pooled: PooledConnection, request: httpcore.Request,
                    on_informational: Informational | None) -> UpstreamResponse:
        """One request on one connection, up to the final head; closes it on failure."""
        stream = pooled.stream
        assert stream is not None, "a connection in use is open"
        sent, received = stream.bytes_sent, stream.bytes_received
        pooled.requests += 1
        pooled.h11.on_informational = on_informational
        stream.head_only = True
        try:
            response = await pooled.http.handle_async_request(request)
        except BaseException as exc:
            self._discard(endpoint, pooled)
            if isinstance(exc, httpcore.TimeoutException):
                raise UpstreamTimeout(f"{endpoint.label}: {exc}", endpoint) from None
            if not isinstance(exc, (httpcore.RemoteProtocolError, httpcore.NetworkError)):
                raise
            cause = exc or type(exc).__name__
            if stream.bytes_received == received:
                was_sent = stream.bytes_sent != sent
                raise UpstreamClosed(
                    f"{endpoint.label} closed the connection "
                    f"{'after the request was sent' if was_sent else 'before the request'}"
                    f", before answering: {cause}", endpoint, request_sent=was_sent) from None
            raise UpstreamProtocolError(f"{endpoint.label}: {cause}", endpoint) from None
        finally:
            pooled.h11.on_informational = None
            stream.head_only = False
        # The body is on the wire; httpcore keeps the request for the
        # response's lifetime, and a stream must not keep the prompt.
        request.stream = _SENT
        return UpstreamResponse(self, endpoint, pooled, response, request.method)

    # -- the pool

    def _checkout(self, endpoint: Endpoint) -> PooledConnection | None:
        if not endpoint.idle:
            return None
        generation = self.trust.current_generation() if endpoint.tls else 0
        now = time.monotonic()
        config = self.config
        while endpoint.idle:
            pooled = endpoint.idle.pop()
            http = pooled.http
            if (http.has_expired() or not http.is_available()
                    or now - pooled.created >= config.upstream_max_age
                    or pooled.generation != generation or pooled.stream is None):
                self._discard(endpoint, pooled)
                continue
            pooled.stream.detach()  # the idle watch ends: the exchange reads now
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
        http, h11_state = http11_connection(endpoint.origin, stream, self.config.upstream_idle)
        endpoint.open += 1
        return PooledConnection(http, stream, h11_state, generation)

    async def _finish(self, endpoint: Endpoint, pooled: PooledConnection,
                      body: _BodyStream) -> None:
        """A response read to its end: pool its connection, or retire it."""
        endpoint.in_flight -= 1
        http = pooled.http
        # httpcore marks the connection idle (both h11 sides DONE). This does
        # not suspend: our lock never waits.
        await body.aclose()
        config = self.config
        stream = pooled.stream
        if (stream is not None and config.upstream_keepalive and http.is_idle()
                and pooled.requests < config.upstream_max_requests
                and time.monotonic() - pooled.created < config.upstream_max_age
                and len(endpoint.idle) < MAX_IDLE_PER_ENDPOINT
                # h11 holds nothing past the response (a length-framed body
                # read with more behind it in the same segment) ...
                and pooled.h11.trailing_data == (b"", False)):
            # ... and nothing came after it. From now on, anything that comes
            # (stray bytes it owes nobody, its keep-alive FIN, a reset) drops
            # the connection as it arrives: stray bytes are never read as the
            # next answer (RFC 9112 section 9.3), and a close seen now is not a
            # request lost later.
            if stream.watch_idle(functools.partial(self._drop_idle, endpoint, pooled)):
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
                http = pooled.http
                if http.has_expired() or now - pooled.created >= config.upstream_max_age:
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
