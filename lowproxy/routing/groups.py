"""Where each leg goes: backend groups, balancing, passive health, DNS discovery.

A BackendGroup holds the endpoints of one role. Static URLs give one endpoint
each; a ``dns+`` URL gives one per address its name resolves to, refreshed in
the background (a headless Kubernetes Service lists its ready pods). An
endpoint whose connection failed is skipped for a short cooldown while others
remain. Endpoints added at run time (POST /instances/add, admin.py) live in
memory beside the configured ones and survive DNS refreshes; a removed one
takes no new requests, and its connections close once its requests finish.

What the active checks learn (health.py) is kept here, per endpoint: health
(out after PD_PROXY_HEALTH_FAILURES failed checks in a row, back after one
success) and the models it serves with their max_model_len (GET /v1/models).
Picks prefer healthy endpoints that serve the request's model (passed in by
the caller; None when the request names none).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import time
from typing import Callable, Iterable

from ..config.settings import EndpointSpec, split_host_port
from ..observability.metrics import Counter
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Resolver, Upstream

log = logging.getLogger("lowproxy.backends")

COOLDOWN_SECONDS = 2.0
# A decode that answered a request this recently is serving, whatever its checks say.
RECENT_ANSWER_SECONDS = 10.0
HEADER_TARGETS_KEPT = 256  # pools kept for scheduler-named prefill targets

# One endpoint's models: served name -> max_model_len (None when not reported).
ModelList = dict[str, "int | None"]


def parse_models(raw: bytes) -> ModelList | None:
    """vLLM's /v1/models answer as {name: max_model_len}; None for another shape."""
    try:
        listed = json.loads(raw).get("data")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(listed, list):
        return None
    models: ModelList = {}
    for entry in listed:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            length = entry.get("max_model_len")
            ok = isinstance(length, int) and not isinstance(length, bool) and length > 0
            models[entry["id"]] = length if ok else None
    return models


def _largest(lengths: Iterable[int | None]) -> int | None:
    """The largest of the contexts; None when one is not known (or there are none)."""
    known = list(lengths)
    if not known or None in known:
        return None
    return max(length for length in known if length is not None)


class BackendGroup:
    def __init__(self, role: str, specs: Iterable[EndpointSpec],
                 sent: Counter | None = None, failed: Counter | None = None) -> None:
        self.role = role
        self.sent = sent  # per endpoint: requests sent (lowproxy_endpoint_requests_total)
        self.failed = failed  # per endpoint: failures (lowproxy_endpoint_failures_total)
        # health.py's knowledge, per endpoint
        self.failed_checks: dict[Endpoint, int] = {}
        self.checked: set[Endpoint] = set()
        self.passed: set[Endpoint] = set()  # passed a check at least once
        self.unhealthy: set[Endpoint] = set()
        self.models: dict[Endpoint, ModelList] = {}
        self.on_new: Callable[[Endpoint], None] | None = None  # an endpoint appeared
        self._healthy: list[Endpoint] = []
        self._serving: dict[str, list[Endpoint]] = {}  # by model: lists it, or unknown
        self._healthy_serving: dict[str, list[Endpoint]] = {}
        self._unlisted: list[Endpoint] = []  # endpoints whose model list is not known
        self._healthy_unlisted: list[Endpoint] = []
        self._lists_known = False
        self._context: dict[str | None, int | None] = {}  # model -> largest max_model_len
        self.specs = tuple(specs)
        self._static = [Endpoint(spec) for spec in self.specs if not spec.discover]
        self._discovered: dict[EndpointSpec, dict[str, Endpoint]] = {
            spec: {} for spec in self.specs if spec.discover}
        self._added: list[Endpoint] = []  # by POST /instances/add: in memory only
        self._resolve_failing: set[EndpointSpec] = set()  # dns+ names failing to resolve
        self.endpoints: list[Endpoint] = list(self._static)
        # Removed while requests were in flight: swept until their connections close.
        self.retired: list[Endpoint] = []
        self._next = 0
        self._reindex()

    @property
    def configured(self) -> bool:
        return bool(self.specs or self._added)

    def _rebuild(self) -> None:
        before = set(self.endpoints)
        self.endpoints = self._static + [endpoint for known in self._discovered.values()
                                         for endpoint in known.values()] + self._added
        present = set(self.endpoints)
        for knowledge in (self.failed_checks, self.models):
            for gone in [endpoint for endpoint in knowledge if endpoint not in present]:
                del knowledge[gone]
        self.checked &= present
        self.passed &= present
        self.unhealthy &= present
        self._reindex()
        if self.on_new is not None:
            for endpoint in self.endpoints:
                if endpoint not in before:
                    self.on_new(endpoint)  # discovered or registered: learn it now

    # -- what the active checks learned (health.py)

    def record_check(self, endpoint: Endpoint, ok: bool, failures_allowed: int) -> bool:
        """One health check's result; True when the endpoint's health changed.

        ``failures_allowed`` in a row take out an endpoint that has passed a
        check before (a flap is forgiven); one that never passed is out at its
        first failure, so a decode unreachable from the start is never ready.
        """
        if endpoint not in self.endpoints:
            return False  # removed while it was being checked
        self.checked.add(endpoint)
        was_out = endpoint in self.unhealthy
        if ok:
            self.failed_checks[endpoint] = 0
            self.passed.add(endpoint)
            if was_out:  # back: a cooldown from while it was out no longer holds
                endpoint.cooldown_until = 0.0
            self.unhealthy.discard(endpoint)
        else:
            self.failed_checks[endpoint] = self.failed_checks.get(endpoint, 0) + 1
            if self.failed is not None:
                self.failed.inc(self.role, endpoint.label, "health")
            if (self.failed_checks[endpoint] >= failures_allowed
                    or endpoint not in self.passed):
                self.unhealthy.add(endpoint)
        changed = was_out != (endpoint in self.unhealthy)
        if changed:
            self._reindex()
        return changed

    def record_models(self, endpoint: Endpoint, models: ModelList) -> None:
        if endpoint in self.endpoints and self.models.get(endpoint) != models:
            self.models[endpoint] = models
            self._reindex()

    def health_state(self, endpoint: Endpoint) -> str:
        if endpoint in self.unhealthy:
            return "unhealthy"
        return "healthy" if endpoint in self.checked else "unknown"

    def lists_known(self) -> bool:
        """Whether every endpoint's model list is known."""
        return self._lists_known

    def serves(self, model: str) -> bool:
        return model in self._context

    def max_model_len(self, model: str | None) -> int | None:
        """The largest context of the endpoints serving ``model``; None if any is unknown."""
        return self._context.get(model) if self._lists_known else None

    def _reindex(self) -> None:
        """The lists picks read: healthy endpoints, and those serving each model."""
        self._healthy = [e for e in self.endpoints if e not in self.unhealthy]
        names = {name for listed in self.models.values() for name in listed}
        multi = len(names) > 1 or (names and len(self.models) < len(self.endpoints))
        self._serving = {} if not multi else {
            name: [e for e in self.endpoints if e not in self.models or name in self.models[e]]
            for name in names}
        self._healthy_serving = {name: [e for e in serving if e not in self.unhealthy]
                                 for name, serving in self._serving.items()}
        self._unlisted = [e for e in self.endpoints if e not in self.models]
        self._healthy_unlisted = [e for e in self._unlisted if e not in self.unhealthy]
        # What each request asks of the model lists, worked out here and not per
        # request: whether every list is known, and each model's largest context
        # (None when any endpoint serving it does not say; key None: any model).
        self._lists_known = bool(self.endpoints) and not self._unlisted
        self._context = {name: _largest(length for listed in self.models.values()
                                        for listed_name, length in listed.items()
                                        if listed_name == name)
                         for name in names}
        if names:
            self._context[None] = _largest(length for listed in self.models.values()
                                           for length in listed.values())

    def candidates(self, model: str | None = None) -> list[Endpoint]:
        """Healthy endpoints that may serve ``model`` (all healthy ones without a model).

        With one model behind the group, or none known, every healthy endpoint.
        A model no list names may be served only by endpoints whose list is not
        known (an endpoint listing other models is not one of them); with every
        list known, by any (the model may have just been loaded).
        """
        if model is None or not self._serving:
            return self._healthy
        serving = self._healthy_serving.get(model)
        if serving is not None:
            return serving
        return self._healthy_unlisted if self._unlisted else self._healthy

    def none_ready(self, model: str | None = None) -> bool:
        """No healthy endpoint for ``model`` that is not cooling down (every one
        failed its checks, or refused a connection moments ago), and none that
        answered a request lately: under load a busy engine's health check can
        time out while it serves, and taking that for down would move every
        prompt onto it (no prefill legs) just when it is busiest."""
        now = time.monotonic()
        for endpoint in self.candidates(model):
            if now >= endpoint.cooldown_until:
                return False
        for endpoint in self.serving(model):
            if now - endpoint.answered_at < RECENT_ANSWER_SECONDS \
                    and now >= endpoint.cooldown_until:
                return False
        return True

    def serving(self, model: str | None = None) -> list[Endpoint]:
        """Endpoints that may serve ``model``, whatever their health."""
        if model is None or not self._serving:
            return self.endpoints
        return self._serving.get(model) or self._unlisted or self.endpoints

    def source(self, endpoint: Endpoint) -> str:
        """Where an endpoint came from: static (a URL), dns (discovered) or admin."""
        if endpoint in self._added:
            return "admin"
        return "dns" if endpoint.spec.discover else "static"

    def find(self, spec: EndpointSpec) -> Endpoint | None:
        """The endpoint at the address ``spec`` names, whatever its source."""
        for endpoint in self.endpoints:
            if (endpoint.spec.scheme, endpoint.connect_host, endpoint.port) == (
                    spec.scheme, spec.host, spec.port):
                return endpoint
        return None

    def add(self, endpoint: Endpoint, models: ModelList | None = None) -> None:
        """Register ``endpoint``; ``models``: the list it answered, routed by at once."""
        self._added.append(endpoint)
        if models is not None:
            self.models[endpoint] = models
        self._rebuild()

    def remove(self, endpoint: Endpoint, upstream: Upstream) -> None:
        """No new requests go to ``endpoint``; those in flight finish on their connections.

        A discovered endpoint is not removed here: the next refresh would bring
        it back (the caller refuses it).
        """
        if endpoint in self._added:
            self._added.remove(endpoint)
        elif endpoint in self._static:
            self._static.remove(endpoint)
        self._rebuild()
        endpoint.removed = True
        upstream.close_idle(endpoint)
        if endpoint.in_flight or endpoint.open:
            self.retired.append(endpoint)

    def sweep_retired(self, upstream: Upstream) -> None:
        """Close what a removed endpoint's finished requests left pooled; forget it then."""
        for endpoint in self.retired:
            upstream.close_idle(endpoint)
        self.retired = [endpoint for endpoint in self.retired
                        if endpoint.in_flight or endpoint.open]

    def usable_count(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        return sum(1 for endpoint in self.endpoints if endpoint.usable(now))

    def ready_count(self, checked_only: bool = False) -> int:
        """Endpoints neither cooling down nor out after failed health checks.

        ``checked_only`` (checks on): only endpoints a check has passed count.
        """
        now = time.monotonic()
        return sum(1 for endpoint in self._healthy if endpoint.usable(now)
                   and (not checked_only or endpoint in self.checked))

    def in_cooldown(self) -> int:
        now = time.monotonic()
        return sum(1 for endpoint in self.endpoints if not endpoint.usable(now))

    def pick_least_loaded(self, exclude: tuple[Endpoint, ...] = (),
                          model: str | None = None) -> Endpoint | None:
        """Fewest requests in flight among healthy endpoints; ties go round robin."""
        endpoints = self.candidates(model)
        count = len(endpoints)
        if count == 1:
            only = endpoints[0]
            if only not in exclude and only.usable(time.monotonic()):
                return self.count_sent(only)
            return None
        now = time.monotonic()
        best: Endpoint | None = None
        start = self._next
        for offset in range(count):
            endpoint = endpoints[(start + offset) % count]
            if endpoint in exclude or not endpoint.usable(now):
                continue
            if best is None or endpoint.in_flight < best.in_flight:
                best = endpoint
        self._next = (start + 1) % count if count else 0
        return self.count_sent(best)

    def pick_round_robin(self, exclude: tuple[Endpoint, ...] = (),
                         model: str | None = None) -> Endpoint | None:
        endpoints = self.candidates(model)
        count = len(endpoints)
        now = time.monotonic()
        for _ in range(count):
            endpoint = endpoints[self._next % count]
            self._next = (self._next + 1) % count
            if endpoint not in exclude and endpoint.usable(now):
                return self.count_sent(endpoint)
        return None

    def count_sent(self, endpoint: Endpoint | None) -> Endpoint | None:
        if endpoint is not None and self.sent is not None:
            self.sent.inc(self.role, endpoint.label)
        return endpoint

    def soonest_usable(self, model: str | None = None) -> Endpoint | None:
        """With every endpoint cooling down, the one whose cooldown ends first.

        A cooldown only prefers the others. With none left, skipping would turn
        one refused connection into seconds of outage, and behind a Service VIP
        (one URL, many pods) the next connection may well reach a live pod.
        Healthy endpoints come first; with none, an unhealthy one is tried
        (its check may be stale by up to an interval).
        """
        endpoints = self.candidates(model) or self.serving(model)
        if not endpoints:
            return None
        return self.count_sent(min(endpoints, key=lambda endpoint: endpoint.cooldown_until))

    def cool_down(self, endpoint: Endpoint) -> None:
        """A connection to ``endpoint`` failed (passive health)."""
        endpoint.cooldown_until = time.monotonic() + COOLDOWN_SECONDS
        if self.failed is not None:
            self.failed.inc(self.role, endpoint.label, "unreachable")

    async def refresh(self, resolver: Resolver, upstream: Upstream) -> None:
        """Resolve every dns+ name again; keep endpoints (and pools) that remain."""
        self.sweep_retired(upstream)
        if not self._discovered:
            return
        for spec, known in self._discovered.items():
            try:
                addresses = await resolver(spec.host, spec.port)
            except Exception as exc:
                if not _no_such_name(exc):  # a transient failure: keep the last answer
                    if spec not in self._resolve_failing:
                        self._resolve_failing.add(spec)  # said once, at the streak's start
                        log.warning("%s: resolving %s failed, keeping %d address(es) "
                                    "until it resolves again: %s",
                                    self.role, spec.label, len(known), exc)
                    continue
                # NXDOMAIN: the name has no address (CoreDNS's answer for a headless
                # Service with no ready pod), not a resolver failing.
                addresses = []
            if spec in self._resolve_failing:
                self._resolve_failing.discard(spec)
                log.info("%s: %s resolves again", self.role, spec.label)
            fresh = {address: known.get(address) or Endpoint(spec, address)
                     for address in addresses}
            for address, endpoint in known.items():
                if address not in fresh:
                    endpoint.removed = True
                    upstream.close_idle(endpoint)
                    if endpoint.in_flight or endpoint.open:
                        # Its streams finish on their connections, which are then
                        # closed by the sweep (close_idle alone missed those in use).
                        self.retired.append(endpoint)
            if set(fresh) != set(known):
                log.info("%s: %s resolves to %s", self.role, spec.label,
                         ", ".join(sorted(fresh)) or "nothing")
            self._discovered[spec] = fresh
        self._rebuild()  # endpoints added at run time stay


def _no_such_name(exc: BaseException) -> bool:
    """A resolver's answer that the name has no address (NXDOMAIN, no data)."""
    return isinstance(exc, socket.gaierror) and exc.errno in _NO_SUCH_NAME


_NO_SUCH_NAME = {code for code in (getattr(socket, "EAI_NONAME", None),
                                   getattr(socket, "EAI_NODATA", None)) if code is not None}


class PrefillTargetAllowList:
    """Which scheduler-named prefill targets (x-prefiller-host-port) may be used.

    Entries are host names, ``host:port`` pairs or CIDRs. Without entries the
    header is ignored altogether: honouring it from anyone would let a client
    make the proxy (and the decode server's KV pull) connect anywhere.
    """

    def __init__(self, entries: Iterable[str]) -> None:
        self.hosts: set[str] = set()
        self.host_ports: set[tuple[str, int]] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            if "/" in entry:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            host, port = split_host_port(entry)
            if port is None:
                self.hosts.add(host)
            else:
                self.host_ports.add((host, port))

    @property
    def enabled(self) -> bool:
        return bool(self.hosts or self.host_ports or self.networks)

    def allows(self, host: str, port: int) -> bool:
        if host in self.hosts or (host, port) in self.host_ports:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.networks)
