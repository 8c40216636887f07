"""Upstream HTTP/1.1: httpcore connections in a pool per endpoint.

Each endpoint keeps its own idle connections. A connection goes back to the
pool only when httpcore has seen both sides of its exchange DONE; anything else
(a response read partly because the client left, an error) closes it. Pooled
connections retire after ``upstream_max_requests`` requests or
``upstream_max_age`` seconds, because kube-proxy balances connections, not
requests: a connection that lived for ever would pin its share of traffic to
one pod. A rotated CA file retires connections made under the old trust.

httpcore is used below its pool: ``AsyncHTTP11Connection`` does the HTTP/1.1
exchange over our asyncio-native stream (netstream.py), and this module owns
reuse, retirement and balancing, which httpcore's pool cannot express.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable

import httpcore

from .config import Config, EndpointSpec
from .chunked import ChunkedDecoder, ChunkedError
from .netstream import AsyncioBackend, AsyncioStream
from .tls import TrustStore, TrustUnavailable

log = logging.getLogger("lowproxy.upstream")

READ_SIZE = 64 * 1024
# Idle connections kept per endpoint; more than this are closed on release.
MAX_IDLE_PER_ENDPOINT = 256


class UpstreamError(Exception):
    """An upstream exchange that failed.

    ``reason`` is stable, for metrics and for choosing the client's answer:
    ``unreachable`` (refused, no route, TLS verification failed; nothing was
    sent), ``untrusted`` (the CA file is unusable: nothing may be sent to any
    https backend), ``timeout``, ``protocol`` (the backend broke HTTP or hung up).
    """

    def __init__(self, reason: str, detail: str, endpoint: "Endpoint | None" = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.endpoint = endpoint


class _Exclusive:
    """A lock that never waits.

    httpcore guards each connection's state with an anyio lock because its own
    pool may share a connection between tasks. Ours never does (one exchange
    per connection at a time, by construction), and anyio's lock costs an
    event-loop round trip per acquire, twice per request.
    """

    async def __aenter__(self) -> "_Exclusive":
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


_EXCLUSIVE = _Exclusive()
_SENT: tuple[bytes, ...] = ()  # an empty body, for requests already sent


class Endpoint:
    """One address to send requests to, with its pool and its load figures."""

    __slots__ = ("spec", "label", "connect_host", "port", "tls", "server_hostname",
                 "origin", "host_header", "base_path", "idle", "in_flight", "open",
                 "cooldown_until", "bootstrap_host")

    def __init__(self, spec: EndpointSpec, address: str | None = None) -> None:
        self.spec = spec
        self.connect_host = address or spec.host
        self.port = spec.port
        self.tls = spec.tls
        # TLS verifies the configured name, never the address it resolved to.
        self.server_hostname = spec.host
        shown = f"[{self.connect_host}]" if ":" in self.connect_host else self.connect_host
        self.label = f"{spec.scheme}://{shown}:{spec.port}"
        self.origin = httpcore.Origin(spec.scheme.encode(), self.connect_host.encode(), spec.port)
        name = f"[{spec.host}]" if ":" in spec.host else spec.host
        self.host_header = f"{name}:{spec.port}".encode()
        self.base_path = spec.base_path.encode()
        # Where a KV bootstrap server of this endpoint listens: its address.
        self.bootstrap_host = self.connect_host
        self.idle: list[_Pooled] = []
        self.in_flight = 0
        self.open = 0
        self.cooldown_until = 0.0

    def usable(self, now: float) -> bool:
        return now >= self.cooldown_until

    def __repr__(self) -> str:
        return f"<Endpoint {self.label} in_flight={self.in_flight} idle={len(self.idle)}>"


class _Pooled:
    """One upstream connection and what decides its retirement."""

    __slots__ = ("http", "stream", "created", "generation", "requests")

    def __init__(self, http: httpcore.AsyncHTTP11Connection, stream: AsyncioStream,
                 generation: int) -> None:
        self.http = http
        self.stream: AsyncioStream | None = stream
        self.created = time.monotonic()
        self.generation = generation
        self.requests = 0


class UpstreamResponse:
    """A backend's response: status and headers now, the body as it arrives.

    Always end it with ``aclose()``: idempotent, and it never suspends, so it
    completes even in the ``finally`` of a cancelled task. The connection
    returns to the pool only if the body was read to its end.
    """

    __slots__ = ("status", "headers", "endpoint", "_pooled", "_response", "_upstream",
                 "_complete", "_closed", "_chunked")

    def __init__(self, upstream: "Upstream", endpoint: Endpoint, pooled: _Pooled,
                 response: httpcore.Response, method: bytes) -> None:
        self.status = response.status
        self.headers: list[tuple[bytes, bytes]] = response.headers
        self.endpoint = endpoint
        self._upstream = upstream
        self._pooled = pooled
        self._response = response
        self._complete = False
        self._closed = False
        # A chunked body (a stream) is decoded here, not by h11: see _relay_chunked.
        self._chunked = (method != b"HEAD" and self.status >= 200
                         and self.status not in (204, 304)
                         and any(name.lower() == b"transfer-encoding"
                                 for name, _ in response.headers))

    async def deliver_body(self, deliver: Deliver,
                           wait_for_consumer: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to ``deliver`` as it arrives: de-chunked, never decompressed.

        ``deliver(pieces)`` gets the pieces one network read brought and answers
        whether its consumer is slow; then reading pauses until
        ``wait_for_consumer()`` returns (back-pressure). Raises UpstreamError when
        the backend breaks off, or whatever ``deliver`` raised.
        """
        try:
            if self._chunked and self._pooled.stream is not None:
                await self._relay_chunked(self._pooled.stream, deliver, wait_for_consumer)
                return
            async for chunk in self._response.stream:  # type: ignore[union-attr]
                if deliver([chunk]):
                    await wait_for_consumer()
        except httpcore.TimeoutException as exc:
            raise UpstreamError("timeout", f"reading from {self.endpoint.label}: {exc}",
                                self.endpoint) from None
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise UpstreamError("protocol", f"{self.endpoint.label} broke off its response: "
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
        relay = _ChunkedRelay(stream, deliver)
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
        async for _ in self._response.stream:  # type: ignore[union-attr]
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
                raise UpstreamError("protocol", f"{self.endpoint.label} answered more than "
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
        await self._upstream._finish(self.endpoint, self._pooled, self._response)

    def abandon(self) -> None:
        """Close the connection now, unread: for responses that will not be relayed."""
        if self._closed:
            return
        self._closed = True
        self.endpoint.in_flight -= 1
        self._upstream._discard(self.endpoint, self._pooled)


Deliver = Callable[[list[bytes]], bool]


async def _never_waits() -> None:  # pragma: no cover - collect() is never slow
    return None


class _ChunkedRelay:
    """Decodes a chunked body in the upstream connection's callbacks and delivers it.

    Errors (broken framing, a hang-up before the last chunk, whatever deliver
    raised, ClientGone among them) are kept for the waiting coroutine to raise.
    """

    __slots__ = ("stream", "deliver", "decoder", "error", "slow", "stray", "_waiter")

    def __init__(self, stream: AsyncioStream, deliver: Deliver) -> None:
        self.stream = stream
        self.deliver = deliver
        self.decoder = ChunkedDecoder()
        self.error: BaseException | None = None
        self.slow = False
        self.stray = False  # bytes arrived after the body ended
        self._waiter: asyncio.Future[None] | None = None

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
        except ChunkedError as exc:
            self.error = httpcore.RemoteProtocolError(str(exc))
        except BaseException as exc:  # raised again by the waiting coroutine
            self.error = exc
        if self.error is not None or self.slow or self.decoder.done:
            self._wake()

    def connection_closed(self, exc: BaseException | None) -> None:
        if self.error is None and not self.decoder.done:
            detail = f": {exc}" if exc else ""
            self.error = httpcore.RemoteProtocolError(f"connection closed mid-body{detail}")
        self._wake()

    async def wait(self) -> None:
        self._waiter = self.stream.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


Resolver = Callable[[str, int], Awaitable[list[str]]]


class Upstream:
    """Opens, reuses and retires upstream connections; owns every endpoint's pool."""

    def __init__(self, config: Config, trust: TrustStore) -> None:
        self.config = config
        self.trust = trust
        self.backend = AsyncioBackend()

    # -- one exchange

    async def request(self, endpoint: Endpoint, method: bytes, target: bytes,
                      headers: list[tuple[bytes, bytes]], body: bytes | None,
                      *, extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> UpstreamResponse:
        """Send one request and return once the response's head has arrived.

        ``headers`` are the end-to-end ones; host and framing are added here. A
        pooled connection that turns out to have been closed by the backend
        before it answered (its keep-alive ran out as we wrote) is replaced by a
        fresh one once: the backend never saw that request.
        """
        wire_headers = [(b"host", endpoint.host_header)]
        wire_headers.extend(headers)
        wire_headers.extend(extra_headers)
        if body is not None:
            wire_headers.append((b"content-length", str(len(body)).encode()))
        url = httpcore.URL(scheme=endpoint.origin.scheme, host=endpoint.origin.host,
                           port=endpoint.port, target=endpoint.base_path + target)
        endpoint.in_flight += 1
        try:
            for attempt in (0, 1):
                pooled = None if attempt else self._checkout(endpoint)
                reused = pooled is not None
                if pooled is None:
                    pooled = await self._connect(endpoint)
                request = httpcore.Request(method, url, headers=wire_headers,
                                           content=body if body is not None else b"")
                pooled.requests += 1
                stream = pooled.stream
                stream.head_only = True
                try:
                    response = await pooled.http.handle_async_request(request)
                except (httpcore.RemoteProtocolError, httpcore.ReadError,
                        httpcore.WriteError) as exc:
                    self._discard(endpoint, pooled)
                    if reused:
                        continue
                    raise UpstreamError("protocol", f"{endpoint.label}: "
                                        f"{exc or type(exc).__name__}", endpoint) from None
                except httpcore.TimeoutException as exc:
                    self._discard(endpoint, pooled)
                    raise UpstreamError("timeout", f"{endpoint.label}: {exc}", endpoint) from None
                except BaseException:
                    self._discard(endpoint, pooled)
                    raise
                stream.head_only = False
                # The body is on the wire; httpcore keeps the request for the
                # response's lifetime, and a stream must not keep the prompt.
                request.stream = _SENT
                return UpstreamResponse(self, endpoint, pooled, response, method)
            raise AssertionError("unreachable")  # pragma: no cover
        except BaseException:
            endpoint.in_flight -= 1
            raise

    # -- the pool

    def _checkout(self, endpoint: Endpoint) -> _Pooled | None:
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
                    or pooled.generation != generation):
                self._discard(endpoint, pooled)
                continue
            return pooled
        return None

    async def _connect(self, endpoint: Endpoint) -> _Pooled:
        ssl_context = None
        generation = 0
        if endpoint.tls:
            try:
                ssl_context = self.trust.context()
            except TrustUnavailable as exc:
                raise UpstreamError("untrusted", str(exc), endpoint) from None
            generation = self.trust.generation
        try:
            stream = await self.backend.connect_tcp(
                endpoint.connect_host, endpoint.port, timeout=self.config.connect_timeout,
                ssl_context=ssl_context, server_hostname=endpoint.server_hostname)
        except httpcore.ConnectTimeout as exc:
            raise UpstreamError("unreachable", str(exc), endpoint) from None
        except httpcore.ConnectError as exc:
            raise UpstreamError("unreachable", str(exc), endpoint) from None
        http = httpcore.AsyncHTTP11Connection(endpoint.origin, stream,
                                              keepalive_expiry=self.config.upstream_idle)
        if hasattr(http, "_state_lock"):
            http._state_lock = _EXCLUSIVE  # see _Exclusive
        endpoint.open += 1
        return _Pooled(http, stream, generation)

    async def _finish(self, endpoint: Endpoint, pooled: _Pooled,
                      response: httpcore.Response) -> None:
        """A response read to its end: pool its connection, or retire it."""
        endpoint.in_flight -= 1
        http = pooled.http
        # httpcore marks the connection idle (both h11 sides DONE). This does
        # not suspend: our lock never waits.
        await response.stream.aclose()  # type: ignore[union-attr]
        config = self.config
        if (config.upstream_keepalive and http.is_idle()
                and pooled.requests < config.upstream_max_requests
                and time.monotonic() - pooled.created < config.upstream_max_age
                and len(endpoint.idle) < MAX_IDLE_PER_ENDPOINT):
            endpoint.idle.append(pooled)
        else:
            self._discard(endpoint, pooled)

    def _discard(self, endpoint: Endpoint, pooled: _Pooled) -> None:
        if pooled.stream is None:
            return
        pooled.stream.close()
        pooled.stream = None
        endpoint.open -= 1

    def sweep(self, endpoints: Iterable[Endpoint]) -> None:
        """Close idle connections past their idle time, age, or closed by the peer."""
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


async def system_resolver(host: str, port: int) -> list[str]:
    """All addresses of a name, as a headless Kubernetes Service publishes its pods."""
    import socket

    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: dict[str, None] = {}
    for info in infos:
        seen.setdefault(str(info[4][0]), None)
    return list(seen)
