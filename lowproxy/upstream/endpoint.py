"""One backend address: its configuration, its pooled connections, its load figures.

Its own module so that routing, the handshakes and dispatch can type an
endpoint without importing the pool that sends to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import h11
import httpcore

from ..config.settings import EndpointSpec
from .stream import AsyncioStream


class Endpoint:
    """One address to send requests to, with its pool and its load figures."""

    __slots__ = ("spec", "label", "connect_host", "port", "tls", "server_hostname",
                 "origin", "host_header", "base_path", "idle", "in_flight", "open",
                 "cooldown_until", "bootstrap_host", "answered_at", "removed")

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
        self.idle: list[PooledConnection] = []
        self.in_flight = 0
        self.open = 0
        self.cooldown_until = 0.0
        self.answered_at = 0.0  # monotonic: decode's last 2xx answer head
        # No longer in its group (removed, undiscovered, evicted): a request chosen
        # before that may still finish on it, and its connection is then closed,
        # not pooled where nothing would ever sweep it.
        self.removed = False

    def usable(self, now: float) -> bool:
        return now >= self.cooldown_until

    def __repr__(self) -> str:
        return f"<Endpoint {self.label} in_flight={self.in_flight} idle={len(self.idle)}>"


class PooledConnection:
    """One upstream connection and what decides its retirement."""

    __slots__ = ("http", "stream", "h11", "created", "generation", "requests", "idle_since",
                 "on_idle_event")

    def __init__(self, http: httpcore.AsyncHTTP11Connection, stream: AsyncioStream,
                 h11_state: h11.Connection, generation: int,
                 on_idle_event: Callable[[PooledConnection], None]) -> None:
        self.http = http  # httpcore's connection: it owns the stream and the h11 state
        self.stream: AsyncioStream | None = stream
        self.h11 = h11_state
        self.created = self.idle_since = time.monotonic()
        self.generation = generation
        self.requests = 0
        # What the idle watch calls, with this connection, when anything arrives.
        # Not a partial holding self: a connection in a reference cycle with
        # itself outlives its close until the cyclic GC runs, with its buffers,
        # h11 state and socket (thousands of them after a burst of new streams).
        self.on_idle_event = on_idle_event
