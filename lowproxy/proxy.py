"""The Proxy: the one object that owns lowproxy's running state, and its handler.

Config, trust, upstream pools, backend groups, the bootstrap cache, metrics and
background tasks all live here and are passed to the stages that need them;
nothing in a module changes after start.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import time
import uuid
from collections import OrderedDict
from typing import Any, Coroutine, Iterable

from . import logs
from .backends import BackendGroup, PrefillTargetAllowList, split_host_port
from .config import Config, EndpointSpec
from .exchange import Exchange, relay_decode, send_decode
from .handshakes import mooncake, relay, sglang
from .handshakes.bootstrap import BootstrapCache
from .handshakes.legs import BodyError, parse_client_body, serialise, wants_stream, without_client_kv
from .headers import forwarded_request_headers
from .metrics import Metrics
from .routes import ADMIN, GENERATION, HEALTH, METRICS, READY, classify
from .messages import ClientRequest, Responder
from .tls import TrustStore
from .tracing import Tracing, trace_context
from .upstream import Endpoint, Resolver, Upstream, system_resolver

log = logging.getLogger("lowproxy")

HANDSHAKES = {"relay": relay.run, "mooncake": mooncake.run, "sglang": sglang.run}
HEADER_TARGETS_KEPT = 256  # pools kept for scheduler-named prefill targets
MAINTENANCE_TICK = 1.0


class Proxy:
    def __init__(self, config: Config, resolver: Resolver | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.trust = TrustStore(config.ca_file)
        if config.ca_file:
            self.trust.context()  # a missing or unusable bundle stops the start
        self.upstream = Upstream(config, self.trust)
        self.prefill = BackendGroup("prefill", config.prefill)
        self.decode = BackendGroup("decode", config.decode)
        self.allow = PrefillTargetAllowList(config.prefill_header_allow)
        self.bootstrap = BootstrapCache(self.upstream, config.mooncake_bootstrap_port,
                                        on_query=self._bootstrap_observed)
        self.handshake = HANDSHAKES[config.kv_protocol]
        self.tracing = Tracing.create(config.otel)
        self.resolver = resolver or system_resolver
        self.draining = False
        self._background: set[asyncio.Task[Any]] = set()
        self._header_targets: OrderedDict[tuple[str, int], Endpoint] = OrderedDict()
        self._maintenance: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._register_gauges()

    # -- life cycle

    async def start(self) -> None:
        # Cached: asyncio.get_running_loop() costs a getpid() syscall on 3.11.
        self.loop = asyncio.get_running_loop()
        await self.refresh_discovery()
        self._maintenance = self.loop.create_task(self._maintain())

    async def refresh_discovery(self) -> None:
        await self.prefill.refresh(self.resolver, self.upstream)
        await self.decode.refresh(self.resolver, self.upstream)

    async def _maintain(self) -> None:
        next_refresh = time.monotonic() + self.config.dns_refresh
        while True:
            await asyncio.sleep(MAINTENANCE_TICK)
            self.upstream.sweep(self.all_endpoints())
            if time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + self.config.dns_refresh
                try:
                    await self.refresh_discovery()
                except Exception:  # pragma: no cover - keep maintaining
                    log.exception("DNS refresh failed")

    async def close(self, grace: float = 0.0) -> None:
        """Stop background work; prefill legs in flight get ``grace`` seconds."""
        if self._maintenance is not None:
            self._maintenance.cancel()
        if self._background and grace > 0:
            await asyncio.wait(list(self._background), timeout=grace)
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=1.0)
        for endpoint in self.all_endpoints():
            self.upstream.close_idle(endpoint)

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A task that outlives its request (a prefill leg left to finish)."""
        task = self.loop.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def all_endpoints(self) -> Iterable[Endpoint]:
        yield from self.prefill.endpoints
        yield from self.decode.endpoints
        yield from self._header_targets.values()
        yield from self.bootstrap.servers()

    # -- the handler

    async def handle(self, request: ClientRequest, responder: Responder) -> None:
        route = classify(request.method, request.path)
        if route == HEALTH:
            await responder.send_bytes(200, b'{"status":"ok"}')
            self.metrics.requests.inc(route, "200")
            return
        if route == READY:
            await self._ready(responder)
            return
        if route == METRICS:
            await self.serve_metrics(responder)
            return
        if self.draining:
            # Probes above are still answered; new work goes to another replica.
            await responder.send_json(503, {"error": {"message": "shutting down",
                                                      "type": "unavailable"}})
            self.metrics.requests.inc(route, "503")
            return
        exchange = self._exchange(request, responder, route)
        self.metrics.in_flight.add(1)
        try:
            if route == ADMIN:
                await self._admin(request, responder)
            elif route == GENERATION:
                await self._generation(exchange)
            else:
                await self._passthrough(exchange)
        finally:
            self.metrics.in_flight.add(-1)
            self._finished(exchange)

    def _exchange(self, request: ClientRequest, responder: Responder, route: str) -> Exchange:
        upstream_headers = forwarded_request_headers(request.headers)
        request_id = request.header(b"x-request-id")
        if request_id is None:
            request_id = uuid.uuid4().hex.encode()
            upstream_headers.append((b"x-request-id", request_id))
        trace_id, span = trace_context(request, upstream_headers, self.config.trace,
                                       self.tracing)
        exchange = Exchange(request, responder, route, request_id.decode("latin-1"),
                            upstream_headers, trace_id)
        exchange.span = span
        return exchange

    def _finished(self, exchange: Exchange) -> None:
        responder = exchange.responder
        status = str(responder.status) if responder.started else "499"
        elapsed_ms = exchange.elapsed_ms()
        self.metrics.requests.inc(exchange.route, status)
        self.metrics.request_duration.observe(elapsed_ms / 1000.0, exchange.route)
        if exchange.span is not None:
            self.tracing.end_request(exchange, int(status),
                                     concurrent=exchange.handshake in ("mooncake", "sglang"))
        logs.access({
            "request_id": exchange.request_id,
            "method": exchange.request.method.decode("latin-1"),
            "path": exchange.request.path,
            "status": status,
            "handshake": exchange.handshake,
            "prefill_ms": _ms(exchange.prefill_ms),
            "decode_first_byte_ms": _ms(exchange.first_byte_ms),
            "total_ms": _ms(elapsed_ms),
            "bytes_out": responder.bytes_out,
            "backend": exchange.decode_backend,
            "prefill_backend": exchange.prefill_backend,
            "trace_id": exchange.trace_id,
        })

    async def _ready(self, responder: Responder) -> None:
        if self.draining:
            reason = "draining"
        elif not self.decode.usable_count():
            reason = ("no decode endpoint configured" if not self.decode.configured
                      else "no usable decode endpoint")
        else:
            await responder.send_bytes(200, b'{"status":"ready"}')
            self.metrics.requests.inc(READY, "200")
            return
        await responder.send_json(503, {"status": "unavailable", "reason": reason})
        self.metrics.requests.inc(READY, "503")

    async def serve_metrics(self, responder: Responder) -> None:
        await responder.send_bytes(200, self.metrics.render(),
                                   [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
        self.metrics.requests.inc(METRICS, "200")

    async def _admin(self, request: ClientRequest, responder: Responder) -> None:
        """The GCO proxy's admin surface: authenticated, answered here, never forwarded."""
        key = self.config.admin_api_key.encode()
        provided = request.header(b"x-admin-api-key")
        if not provided:
            authorization = request.header(b"authorization") or b""
            scheme, _, token = authorization.partition(b" ")
            provided = token.strip() if scheme.lower() == b"bearer" else b""
        if (request.method == b"POST" and key and provided
                and hmac.compare_digest(provided, key)):
            await responder.send_bytes(200, b'{"status":"ok"}')
        else:
            await responder.send_bytes(403, b'{"error":"forbidden"}')

    async def _generation(self, exchange: Exchange) -> None:
        request = exchange.request
        try:
            body = without_client_kv(parse_client_body(request.body))
        except BodyError as exc:
            await exchange.responder.send_json(400, {"error": str(exc)})
            return
        request.body = b""  # parsed: a long stream must not keep the raw prompt too
        exchange.wants_stream = wants_stream(body)
        try:
            prefill = self._choose_prefill(request)
        except _TargetRefused as refused:
            await exchange.responder.send_json(refused.status, {"error": {
                "message": refused.message, "type": "prefill_target_refused"}})
            return
        exchange.responder.watch_client()
        if prefill is None and self.prefill.configured:
            self.metrics.prefill_legs.inc(self.config.kv_protocol, "error")
            logs.warn(log, "no prefill endpoint: the configured dns+ names resolve to no "
                      "address", exchange.request_id)
            if self.config.on_prefill_failure == "error":
                await exchange.responder.send_json(502, {"error": {
                    "message": "prefill failed: no usable prefill endpoint",
                    "type": "prefill_failed", "code": 502}})
                return
        exchange.handshake = self.config.kv_protocol
        if prefill is None:  # no prefill configured: decode computes the prompt itself
            response = await send_decode(self, exchange, b"POST", request.target,
                                         serialise(body))
        else:
            response = await self.handshake(self, exchange, body, prefill)
        del body  # the handshake's frames are gone; so is every copy of the prompt
        if response is not None:
            await relay_decode(self, exchange, response)

    async def _passthrough(self, exchange: Exchange) -> None:
        request = exchange.request
        body = None
        if request.method == b"POST":
            try:
                parsed = parse_client_body(request.body)
            except BodyError as exc:
                await exchange.responder.send_json(400, {"error": str(exc)})
                return
            exchange.wants_stream = wants_stream(parsed)
            body = serialise(without_client_kv(parsed))
            del parsed
        elif request.body:
            body = request.body
        request.body = b""
        exchange.responder.watch_client()
        response = await send_decode(self, exchange, request.method, request.target, body)
        del body
        if response is not None:
            await relay_decode(self, exchange, response)

    # -- prefill target

    def _choose_prefill(self, request: ClientRequest) -> Endpoint | None:
        """The scheduler's choice (x-prefiller-host-port) when allowed, else round robin."""
        named = request.header(b"x-prefiller-host-port")
        if named is not None and self.allow.enabled:
            targets = []
            for item in named.decode("latin-1").split(","):
                if not item.strip():
                    continue
                try:
                    host, port = split_host_port(item)
                except ValueError:
                    port = None
                if port is None:
                    raise _TargetRefused(400, "x-prefiller-host-port must be host:port")
                if not self.allow.allows(host, port):
                    logs.warn(log, f"refused prefill target {host}:{port}: not in "
                              "PD_PROXY_PREFILL_HEADER_ALLOW", None)
                    raise _TargetRefused(403, "prefill target not allowed")
                targets.append((host, port))
            if targets:
                return self._header_target(random.choice(targets))
        endpoint = self.prefill.pick_round_robin()
        if endpoint is None:
            endpoint = self.prefill.soonest_usable()  # all cooling down: try one anyway
        return endpoint

    def _header_target(self, key: tuple[str, int]) -> Endpoint:
        # A scheduler usually names one of the configured (or discovered) prefills:
        # use that endpoint, with its pool and its #bootstrap_port override.
        for configured in self.prefill.endpoints:
            if (configured.connect_host, configured.port) == key:
                return configured
        endpoint = self._header_targets.get(key)
        if endpoint is not None:
            self._header_targets.move_to_end(key)
            return endpoint
        scheme = self.config.prefill[0].scheme if self.config.prefill else "http"
        endpoint = Endpoint(EndpointSpec(scheme, key[0], key[1]))
        self._header_targets[key] = endpoint
        while len(self._header_targets) > HEADER_TARGETS_KEPT:
            _, evicted = self._header_targets.popitem(last=False)
            self.upstream.close_idle(evicted)
        return endpoint

    # -- metrics read at scrape time

    def _bootstrap_observed(self, seconds: float, ok: bool) -> None:
        self.metrics.bootstrap_duration.observe(seconds, "ok" if ok else "error")

    def _register_gauges(self) -> None:
        metrics = self.metrics

        def connections() -> Iterable[tuple[tuple[str, ...], float]]:
            for role, endpoints in (("prefill", self.prefill.endpoints),
                                    ("decode", self.decode.endpoints),
                                    ("prefill", self._header_targets.values())):
                for endpoint in endpoints:
                    yield (role, endpoint.label, "open"), endpoint.open
                    yield (role, endpoint.label, "idle"), len(endpoint.idle)

        metrics.upstream_connections.read = connections
        metrics.cooldown.read = lambda: [(("prefill",), self.prefill.in_cooldown()),
                                         (("decode",), self.decode.in_cooldown())]
        metrics.bootstrap_entries.read = lambda: [((), len(self.bootstrap))]


class _TargetRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value:.1f}"
