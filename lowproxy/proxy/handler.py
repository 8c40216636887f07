"""The Proxy: the one object that owns lowproxy's running state, and its handler.

Config, trust, upstream pools, backend groups, the bootstrap cache, metrics and
background work all live here and are handed to the stages that need them;
nothing in a module changes after start. ``handle`` routes one request: probes,
metrics and the admin path are answered here; generation requests are planned
(handshakes/) and run by the dispatcher; everything else passes to decode.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from typing import Iterable

from .. import __version__, answers
from ..config.settings import Config
from ..downstream.messages import ClientRequest, ResponseWriter
from ..handshakes.bootstrap import BootstrapCache
from ..handshakes.client_body import BodyError, parse_client_body, wants_stream, without_client_kv
from ..handshakes.legs import decode_only_plan, serialise
from ..handshakes.planner import Generation, plan_generation, refusal_rules
from ..headers import connection_tokens, forwarded_request_headers, header_value
from ..ids import Ids
from ..keys import BackendKey, ClientKeys
from ..observability import logs
from ..observability.metrics import Metrics
from ..routes import (
    ADMIN,
    HEALTH,
    MESSAGES,
    METRICS,
    PASSTHROUGH,
    READY,
    RESPONSES,
    classify,
    route_and_surface,
    speaks_anthropic,
)
from ..routing.affinity import PromptFacts, prompt_facts
from ..routing.blocks import NO_BLOCKS, PromptBlocks
from ..routing.cache_router import CacheRouter
from ..routing.engine_load import EngineLoads
from ..routing.groups import BackendGroup, PrefillTargetAllowList
from ..routing.health import HealthMonitor
from ..routing.peers import PEERS_PATH, PeerShare
from ..routing.prefill import PrefillChooser, TargetRefused
from ..routing.response_homes import home_of, id_in_path, placeholder
from ..routing.worker_share import WorkerShare
from ..tls import TrustStore
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Resolver, Upstream, system_resolver
from .admin import Instances
from .dispatch import Dispatcher
from .exchange import Exchange
from .tracing import Tracing, trace_context

log = logging.getLogger("lowproxy")

MAINTENANCE_TICK = 1.0
METRICS_TYPE = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]


class Proxy:
    def __init__(self, config: Config, resolver: Resolver | None = None) -> None:
        self.config = config
        # SGLang's native POST /generate is a generation surface under its handshake.
        self.sglang = config.kv_protocol == "sglang"
        self.refused_before_legs = refusal_rules(config.kv_protocol)
        self.metrics = Metrics()
        self.trust = TrustStore(config.ca_file)
        if config.ca_file:
            self.trust.context()  # a missing or unusable bundle stops the start
        self.upstream = Upstream(config, self.trust)
        counted = (self.metrics.endpoint_requests, self.metrics.endpoint_failures)
        self.prefill = BackendGroup("prefill", config.prefill, *counted)
        self.decode = BackendGroup("decode", config.decode, *counted)
        # keys.py: the backend key on every leg, the client keys every request needs
        self.backend_key = BackendKey(config.backend_api_key, config.backend_api_key_file)
        # What the engines report of their load, and cache-aware routing over it.
        self.engine_loads = EngineLoads(self.upstream, (self.prefill, self.decode),
                                        config.health_interval, config.health_timeout,
                                        self.backend_key.headers)
        self.router = CacheRouter(config, self.engine_loads) \
            if config.prefill_policy == "cache-aware" else None
        self.prefill_choice = PrefillChooser(
            self.prefill, PrefillTargetAllowList(config.prefill_header_allow), self.upstream,
            config.prefill_policy, config.affinity_slack, self.metrics.prefill_choice,
            self.router)
        self.bootstrap = BootstrapCache(self.upstream, config.mooncake_bootstrap_port,
                                        on_query=self.metrics.bootstrap_duration.observe)
        self.tracing = Tracing.create(config.otel)
        self.dispatch = Dispatcher(config, self.upstream, self.prefill, self.decode,
                                   self.bootstrap, self.metrics, self.tracing,
                                   prefill_ended=self._prefill_ended)
        if self.router is not None:
            self.dispatch.engine_loads = self.engine_loads  # prefill legs ask for ORCA
        self.resolver = resolver or system_resolver
        self.client_keys = ClientKeys(config.client_api_keys, config.client_api_keys_file)
        self.instances = Instances(config.admin_api_key, self.prefill, self.decode,
                                   self.upstream, self.backend_key, config.workers)
        # A restart the health checks saw: the prefill's Mooncake engine map is learned again.
        self.health = HealthMonitor(config, self.upstream, self.prefill, self.decode,
                                    self.backend_key, self.bootstrap.health_checked
                                    if config.kv_protocol == "mooncake" else None)
        # PD_PROXY_PEERS: prefill choices told to and by the other replicas.
        self.peers = PeerShare(config, self.upstream, self.router, self.prefill,
                               self.metrics) if config.peers and self.router else None
        self.worker_share: WorkerShare | None = None  # share_with_workers
        self.draining = False
        self.ids = Ids()  # generated request ids, transfer ids and rids
        self._maintenance: asyncio.Task[None] | None = None
        self._register_gauges()

    # -- life cycle

    def share_with_workers(self, directory: str, index: int) -> None:
        """--workers: prefill choices shared with the sibling workers (worker_share.py)."""
        if self.router is not None and self.config.workers > 1:
            self.worker_share = WorkerShare(directory, index, self.config.workers,
                                            self.router, self.prefill, self.metrics)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop_name = "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
        self.metrics.build_info = (__version__, platform.python_version(), loop_name)
        self.dispatch.start(loop)
        await self.refresh_discovery()
        self.health.start(loop)  # checks and model lists, in the background
        await self.health.first_checks()  # bounded: ready only once decode was checked
        if self.router is not None:
            self.engine_loads.start(loop)  # /metrics every health interval
        if self.peers is not None:
            self.peers.start(loop)
        if self.worker_share is not None:
            self.worker_share.start(loop)
        self._maintenance = loop.create_task(self._maintain())

    async def refresh_discovery(self) -> None:
        await self.prefill.refresh(self.resolver, self.upstream)
        await self.decode.refresh(self.resolver, self.upstream)
        if self.peers is not None:
            await self.peers.refresh(self.resolver)

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
        await self.health.close()
        await self.engine_loads.close()
        if self.peers is not None:
            await self.peers.close()
        if self.worker_share is not None:
            self.worker_share.close()
        await self.dispatch.close(grace)
        await self.bootstrap.close()
        for endpoint in self.all_endpoints():
            self.upstream.close_idle(endpoint)

    def all_endpoints(self) -> Iterable[Endpoint]:
        yield from self.prefill.endpoints
        yield from self.decode.endpoints
        yield from self.prefill.retired
        yield from self.decode.retired
        yield from self.prefill_choice.named.values()
        yield from self.bootstrap.servers()
        if self.peers is not None:
            yield from self.peers.endpoints()

    # -- the handler

    async def handle(self, request: ClientRequest, responder: ResponseWriter) -> None:
        route, surface = route_and_surface(request.method, request.path, self.sglang)
        if route == HEALTH:
            await self._local(responder, route, 200, answers.HEALTH_OK)
            return
        if route == READY:
            await self._ready(responder)
            return
        keyless = route == METRICS  # /metrics needs no client key, wherever it goes
        if keyless:
            if not self.config.metrics_port:
                await self._metrics(responder)
                return
            # With a metrics port, lowproxy's own (whose labels name backends) are
            # served only there, and the main port passes /metrics on to decode,
            # as the GCO proxy and llm-d's sidecar do (llm-d's scheduler scrapes
            # vLLM's series through the port it routes to; vLLM's --api-key
            # does not guard it).
            route = PASSTHROUGH
        if route == PASSTHROUGH and self.peers is not None and request.path == PEERS_PATH:
            await self._peer_batch(request, responder)  # the peers' own key, not a client's
            return
        if self.client_keys.required and route != ADMIN and not keyless:
            anthropic = speaks_anthropic(request.path)
            if not self.client_keys.allows(request.header(b"authorization"),
                                           request.header(b"x-api-key") if anthropic else None):
                # Headers given replace send_bytes' default content-type: name it again.
                await self._local(responder, route, 401, answers.unauthorized(anthropic),
                                  [(b"content-type", b"application/json"),
                                   (b"www-authenticate", b"Bearer")])  # RFC 6750 3
                return
        if self.draining:
            # Probes above are still answered; new work goes to another replica.
            await self._local(responder, route, 503,
                              answers.shutting_down(speaks_anthropic(request.path)))
            return
        exchange = self._exchange(request, route)
        # The client's x-request-id, or the one made here, comes back with the answer.
        responder.add_header(b"x-request-id", exchange.request_id.encode("latin-1"))
        self.metrics.in_flight.add(1)
        try:
            if route == ADMIN:
                await self.instances.handle(request, responder)
            elif surface is not None:  # route GENERATION
                await self._generation(exchange, responder, surface)
            else:
                await self._passthrough(exchange, responder)
        finally:
            self.metrics.in_flight.add(-1)
            self._finished(exchange, responder)

    async def _peer_batch(self, request: ClientRequest, responder: ResponseWriter) -> None:
        """Another replica's prefill choices (routing/peers.py); the admin key when set."""
        assert self.peers is not None
        if self.config.admin_api_key and not self.instances.authorised(request):
            status, body = 403, answers.ADMIN_FORBIDDEN
        elif request.method != b"POST":
            status, body = 405, answers.error_body(405, "use POST on this path",
                                                   "method_not_allowed")
        else:
            status, body = self.peers.receive(request.body)
        request.body = b""
        await self._local(responder, "peers", status, body)

    async def handle_probes_only(self, request: ClientRequest,
                                 responder: ResponseWriter) -> None:
        """The metrics listener: /metrics and the probes, nothing that reaches a backend."""
        route = classify(request.method, request.path)
        if request.method not in (b"GET", b"HEAD") or route not in (HEALTH, READY, METRICS):
            await responder.send_bytes(404, answers.NOT_FOUND)
        elif route == METRICS:
            await self._metrics(responder)
        else:
            await self.handle(request, responder)

    async def _metrics(self, responder: ResponseWriter) -> None:
        await self._local(responder, METRICS, 200, self.metrics.render(), list(METRICS_TYPE))

    async def _local(self, responder: ResponseWriter, route: str, status: int, body: bytes,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await responder.send_bytes(status, body, headers)
        self.metrics.requests.inc(route, str(status))

    def _exchange(self, request: ClientRequest, route: str) -> Exchange:
        upstream_headers = forwarded_request_headers(request.headers)
        if self.config.forward_authorization:  # the client's own key, to both legs
            # The first only: the one PD_PROXY_CLIENT_API_KEYS checked (a backend
            # reading another would take a key lowproxy never checked), and none
            # when the client's Connection names it (hop-by-hop).
            presented = request.header(b"authorization")
            if presented is not None and b"authorization" not in connection_tokens(
                    request.headers):
                upstream_headers.append((b"authorization", presented))
        else:
            upstream_headers += self.backend_key.headers()  # none without a backend key
        # The forwarded one: an x-request-id the client's Connection names is not.
        request_id = header_value(upstream_headers, b"x-request-id")
        if request_id is None:
            request_id = self.ids.next_hex().encode()
            upstream_headers.append((b"x-request-id", request_id))
        trace_id, span = trace_context(request, upstream_headers, self.config.trace,
                                       self.tracing)
        return Exchange(request, route, request_id.decode("latin-1"), upstream_headers,
                        trace_id, span)

    def _finished(self, exchange: Exchange, responder: ResponseWriter) -> None:
        status = responder.status if responder.started else 499  # an int in JSON log lines
        elapsed_ms = exchange.elapsed_ms()
        self.metrics.requests.inc(exchange.route, str(status))
        self.metrics.request_duration.observe(elapsed_ms / 1000.0, exchange.route)
        if exchange.span is not None and self.tracing is not None:
            self.tracing.end_request(exchange, status,
                                     concurrent=exchange.handshake in ("mooncake", "sglang"))
        if not logs.access_enabled():  # below info: no line, so no fields either
            return
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
            "prefill_skipped": exchange.skip_reason,
            "trace_id": exchange.trace_id,
        })

    async def _ready(self, responder: ResponseWriter) -> None:
        if self.draining:
            reason = "draining"
        elif not self.decode.ready_count(checked_only=self.health.active):
            reason = ("no decode endpoint configured" if not self.decode.configured
                      else "no decode address resolved" if not self.decode.endpoints
                      else "decode not checked yet" if self.health.active
                      and not self.decode.checked
                      else "no healthy decode endpoint" if self.decode.usable_count()
                      else "no usable decode endpoint")
        else:
            await self._local(responder, READY, 200, answers.READY_OK)
            return
        await self._local(responder, READY, 503, answers.not_ready(reason))

    # -- requests that reach backends

    async def _generation(self, exchange: Exchange, responder: ResponseWriter,
                          surface: str) -> None:
        request = exchange.request
        body_bytes = len(request.body)
        try:
            body = without_client_kv(parse_client_body(request.body))
        except BodyError as exc:
            await responder.send_bytes(400, answers.invalid_body(str(exc)))
            return
        request.body = b""  # parsed: a long stream must not keep the raw prompt too
        if (rejected := self.refused_before_legs(body, surface)) is not None:
            # Decode would reject it after prefill computed a KV nobody reads.
            await responder.send_bytes(400, answers.invalid_request(
                *rejected, anthropic=surface == MESSAGES))
            return
        exchange.wants_stream = wants_stream(body)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        # Model knowledge: 404, 400.
        refused_here = await self.health.refuse(model, body, surface)
        if refused_here is not None:
            await responder.send_bytes(*refused_here)
            return
        try:
            named = self.prefill_choice.named_target(request.header(b"x-prefiller-host-port"))
        except TargetRefused as refused:
            if refused.target:  # client bytes go in a field, escaped, not in the message
                logs.warn(log, "refused prefill target: not in PD_PROXY_PREFILL_HEADER_ALLOW",
                          None, target=refused.target)
            await responder.send_bytes(refused.status, answers.prefill_target_refused(
                refused.status, refused.message, surface == MESSAGES))
            return
        request.watch_client()
        request.headers = []  # read (keys, trace, target, the legs' own): a stream keeps none
        exchange.handshake = self.config.kv_protocol
        exchange.surface = surface
        facts = self._prompt_facts(surface, body)
        router = self._routing_with_choice()
        blocks = NO_BLOCKS if router is None else router.blocks(surface, body)
        decode_cached = router is not None and self._decode_first(exchange, router, blocks,
                                                                  model, named)
        if surface == RESPONSES and exchange.handshake != "sglang":
            self._name_response(exchange, body)
        exchange.prefill_lease = self.prefill_choice.lease(named, facts, model, blocks)
        # What decode's memory records once it answers; not the prompt (a stream may last
        # minutes, and the blocks carry the rendered prompt and the body for the choice).
        blocks = blocks.without_prompt()
        planning = plan_generation(self.config, self.bootstrap, self.ids,
                                   Generation(surface, request.target, request.path_bytes, body,
                                              facts.size, decode_cached, body_bytes),
                                   exchange.prefill_lease)
        del body  # the plan holds it until decode's response is open, and no longer
        exchange.model = model  # decode's pick: endpoints serving the model
        # The planning coroutine is the dispatcher's alone from here (it drops it once
        # planned): a finished one kept in this frame would stay for the whole stream.
        dispatched = self.dispatch.run(exchange, responder, planning)
        del planning
        try:
            await dispatched
        finally:
            if router is not None and exchange.decode_endpoint is not None \
                    and exchange.first_byte_ms is not None:
                router.served_decode(exchange.decode_endpoint, blocks)

    def _name_response(self, exchange: Exchange, body: dict) -> None:
        """Stored responses live in the decode that made them (routing/response_homes.py):
        a follow-up goes there, and a new response's id names its decode.

        The body gets a placeholder ``request_id`` (vLLM's response id) unless the
        client set one; dispatch writes the id naming the decode into each decode
        leg it sends. With one decode there is nothing to find, and decode gets the
        client's body as the GCO proxy sent it. Not under sglang, whose legs carry
        lowproxy's rid."""
        decodes = self.decode.endpoints
        home = home_of(body.get("previous_response_id"), decodes)
        if home is not None:
            exchange.decode_preferred = home  # only its store holds the conversation
        if len(decodes) > 1 and "request_id" not in body:
            slot = placeholder()
            body["request_id"] = slot
            exchange.response_slot = slot.encode()

    def _routing_with_choice(self) -> CacheRouter | None:
        """The cache-aware router, when it has something to choose: with one prefill and
        one decode configured (and decode-first off) there is none, and the prompt is
        neither rendered nor remembered (the memory starts with a second endpoint)."""
        router = self.router
        if router is not None and len(self.prefill.endpoints) < 2 \
                and len(self.decode.endpoints) < 2 and not self.config.decode_first_tokens:
            return None
        return router

    @staticmethod
    def _prefill_ended(exchange: Exchange) -> None:
        """Dispatch says the prefill leg is over (or none was sent): its load goes."""
        if exchange.prefill_lease is not None:
            exchange.prefill_lease.release()

    def _decode_first(self, exchange: Exchange, router: CacheRouter, blocks: PromptBlocks,
                      model: str | None, named: Endpoint | None) -> bool:
        """The decode holding the conversation, if its load allows; whether it may
        compute the rest itself (no prefill leg: decode-cached)."""
        router.prune("decode", self.decode.endpoints)
        now = time.monotonic()
        usable = [e for e in self.decode.candidates(model) if e.usable(now)]
        preferred, lacks = router.choose_decode(usable, blocks)
        exchange.decode_preferred = preferred
        return preferred is not None and named is None and router.decode_cached(lacks)

    def _prompt_facts(self, surface: str, body: dict) -> PromptFacts:
        """The prefix key and prompt size, when a setting reads them."""
        config = self.config
        if config.prefill_policy in ("round-robin", "cache-aware") \
                and not config.min_prefill_prompt_bytes:
            return PromptFacts(None, None)
        return prompt_facts(surface, body)

    async def _passthrough(self, exchange: Exchange, responder: ResponseWriter) -> None:
        request = exchange.request
        body = None
        if request.method == b"POST" and _is_form(request.header(b"content-type")):
            # vLLM's audio APIs (/v1/audio/transcriptions, /translations) take
            # multipart forms: relayed as they came, with their boundary; nothing
            # in a form is a prefill/decode field.
            body = request.body
        elif request.method == b"POST":
            try:
                parsed = parse_client_body(request.body)
            except BodyError as exc:
                await responder.send_bytes(400, answers.invalid_body(str(exc)))
                return
            exchange.wants_stream = wants_stream(parsed)
            body = serialise(without_client_kv(parsed))
            del parsed
        elif request.body:
            body = request.body
        request.body = b""
        request.watch_client()
        request.headers = []  # read (keys, trace, the legs' own): a stream keeps none
        # GET /v1/responses/{id}, its cancel: to the decode whose store holds it.
        exchange.decode_preferred = home_of(id_in_path(request.path), self.decode.endpoints)
        await self.dispatch.run(exchange, responder,
                                decode_only_plan(request.method, request.target, body))

    # -- metrics read at scrape time

    def _register_gauges(self) -> None:
        metrics = self.metrics

        def connections() -> Iterable[tuple[tuple[str, ...], float]]:
            # Retired ones too: a removed endpoint's long streams still hold theirs.
            for role, endpoints in (("prefill", self.prefill.endpoints),
                                    ("prefill", self.prefill.retired),
                                    ("decode", self.decode.endpoints),
                                    ("decode", self.decode.retired),
                                    ("prefill", self.prefill_choice.named.values())):
                for endpoint in endpoints:
                    yield (role, endpoint.label, "open"), endpoint.open
                    yield (role, endpoint.label, "idle"), len(endpoint.idle)

        metrics.upstream_connections.read = connections
        metrics.cooldown.read = lambda: [(("prefill",), self.prefill.in_cooldown()),
                                         (("decode",), self.decode.in_cooldown())]
        metrics.bootstrap_entries.read = lambda: [((), len(self.bootstrap))]
        metrics.endpoint_health.read = self.health.health_states
        metrics.endpoint_in_flight.read = self.health.in_flight
        metrics.endpoint_engine_load.read = self.engine_loads.gauges


def _is_form(content_type: bytes | None) -> bool:
    return content_type is not None and content_type[:19].lower() == b"multipart/form-data"


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)  # a number in JSON log lines


__all__ = ["Proxy"]
