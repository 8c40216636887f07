"""Where each leg goes: backend groups, balancing, passive health, DNS discovery.

A BackendGroup holds the endpoints of one role. Static URLs give one endpoint
each; a ``dns+`` URL gives one per address its name resolves to, refreshed in
the background (a headless Kubernetes Service lists its ready pods). An
endpoint whose connection failed is skipped for a short cooldown while others
remain. Endpoints added at run time (POST /instances/add, admin.py) live in
memory beside the configured ones and survive DNS refreshes; a removed one
takes no new requests, and its connections close once its requests finish.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import time
from collections import OrderedDict
from typing import Iterable

from .config import EndpointSpec, split_host_port
from .upstream import Endpoint, Resolver, Upstream

log = logging.getLogger("lowproxy.backends")

COOLDOWN_SECONDS = 2.0
HEADER_TARGETS_KEPT = 256  # pools kept for scheduler-named prefill targets


class BackendGroup:
    def __init__(self, role: str, specs: Iterable[EndpointSpec]) -> None:
        self.role = role
        self.specs = tuple(specs)
        self._static = [Endpoint(spec) for spec in self.specs if not spec.discover]
        self._discovered: dict[EndpointSpec, dict[str, Endpoint]] = {
            spec: {} for spec in self.specs if spec.discover}
        self._added: list[Endpoint] = []  # by POST /instances/add: in memory only
        self.endpoints: list[Endpoint] = list(self._static)
        # Removed while requests were in flight: swept until their connections close.
        self.retired: list[Endpoint] = []
        self._next = 0

    @property
    def configured(self) -> bool:
        return bool(self.specs or self._added)

    def _rebuild(self) -> None:
        self.endpoints = self._static + [endpoint for known in self._discovered.values()
                                         for endpoint in known.values()] + self._added

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

    def add(self, endpoint: Endpoint) -> None:
        self._added.append(endpoint)
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

    def in_cooldown(self) -> int:
        now = time.monotonic()
        return sum(1 for endpoint in self.endpoints if not endpoint.usable(now))

    def pick_least_loaded(self, exclude: tuple[Endpoint, ...] = ()) -> Endpoint | None:
        """Fewest requests in flight; ties go round robin."""
        endpoints = self.endpoints
        count = len(endpoints)
        if count == 1:
            only = endpoints[0]
            return only if only not in exclude and only.usable(time.monotonic()) else None
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
        return best

    def pick_round_robin(self, exclude: tuple[Endpoint, ...] = ()) -> Endpoint | None:
        endpoints = self.endpoints
        count = len(endpoints)
        now = time.monotonic()
        for _ in range(count):
            endpoint = endpoints[self._next % count]
            self._next = (self._next + 1) % count
            if endpoint not in exclude and endpoint.usable(now):
                return endpoint
        return None

    def soonest_usable(self) -> Endpoint | None:
        """With every endpoint cooling down, the one whose cooldown ends first.

        A cooldown only prefers the others. With none left, skipping would turn
        one refused connection into seconds of outage, and behind a Service VIP
        (one URL, many pods) the next connection may well reach a live pod.
        """
        if not self.endpoints:
            return None
        return min(self.endpoints, key=lambda endpoint: endpoint.cooldown_until)

    @staticmethod
    def cool_down(endpoint: Endpoint) -> None:
        endpoint.cooldown_until = time.monotonic() + COOLDOWN_SECONDS

    async def refresh(self, resolver: Resolver, upstream: Upstream) -> None:
        """Resolve every dns+ name again; keep endpoints (and pools) that remain."""
        self.sweep_retired(upstream)
        if not self._discovered:
            return
        for spec, known in self._discovered.items():
            try:
                addresses = await resolver(spec.host, spec.port)
            except Exception as exc:  # keep the last good answer
                log.warning("%s: resolving %s failed, keeping %d address(es): %s",
                            self.role, spec.label, len(known), exc)
                continue
            fresh = {address: known.get(address) or Endpoint(spec, address)
                     for address in addresses}
            for address, endpoint in known.items():
                if address not in fresh:
                    upstream.close_idle(endpoint)
            if set(fresh) != set(known):
                log.info("%s: %s resolves to %s", self.role, spec.label,
                         ", ".join(sorted(fresh)) or "nothing")
            self._discovered[spec] = fresh
        self._rebuild()  # endpoints added at run time stay


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


class TargetRefused(Exception):
    """A scheduler-named prefill target that may not be used; ``status`` is the answer."""

    def __init__(self, status: int, message: str, target: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.target = target


class PrefillChooser:
    """Which prefill endpoint a request's prefill leg goes to.

    A scheduler's choice (``x-prefiller-host-port``, llm-d's convention) wins
    when the allow list admits it; otherwise round robin over the group. A
    named target that is one of the group's endpoints uses that endpoint (its
    pool, its ``#bootstrap_port``); others get endpoints of their own, kept in
    a bounded LRU so their pools are reused.
    """

    def __init__(self, group: BackendGroup, allow: PrefillTargetAllowList,
                 upstream: Upstream) -> None:
        self.group = group
        self.allow = allow
        self.upstream = upstream
        self.named: OrderedDict[tuple[str, int], Endpoint] = OrderedDict()

    def choose(self, named_header: bytes | None) -> Endpoint | None:
        if named_header is not None and self.allow.enabled:
            targets = self._named_targets(named_header)
            if targets:
                return self._named_endpoint(random.choice(targets))
        endpoint = self.group.pick_round_robin()
        if endpoint is None:
            endpoint = self.group.soonest_usable()  # all cooling down: try one anyway
        return endpoint

    def _named_targets(self, header: bytes) -> list[tuple[str, int]]:
        targets = []
        for item in header.decode("latin-1").split(","):
            if not item.strip():
                continue
            try:
                host, port = split_host_port(item)
            except ValueError:
                port = None
            if port is None:
                raise TargetRefused(400, "x-prefiller-host-port must be host:port")
            if not self.allow.allows(host, port):
                raise TargetRefused(403, "prefill target not allowed", f"{host}:{port}")
            targets.append((host, port))
        return targets

    def _named_endpoint(self, key: tuple[str, int]) -> Endpoint:
        for configured in self.group.endpoints:
            if (configured.connect_host, configured.port) == key:
                return configured
        endpoint = self.named.get(key)
        if endpoint is not None:
            self.named.move_to_end(key)
            return endpoint
        scheme = self.group.specs[0].scheme if self.group.specs else "http"
        endpoint = Endpoint(EndpointSpec(scheme, key[0], key[1]))
        self.named[key] = endpoint
        while len(self.named) > HEADER_TARGETS_KEPT:
            _, evicted = self.named.popitem(last=False)
            self.upstream.close_idle(evicted)
        return endpoint
