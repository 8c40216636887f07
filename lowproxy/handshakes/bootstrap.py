"""The Mooncake bootstrap map: which engine id serves each data-parallel rank.

vLLM 0.16+ prefill runs a bootstrap server (rank 0 worker, plain HTTP) whose
``GET /query`` answers ``{"<rank>": {"engine_id": ...}, ...}``. Decode needs
the engine id of the rank that computed the KV. Engine ids are random per
start, so the answer is cached per prefill endpoint (LRU, bounded) and dropped
when a request to that endpoint fails: a restarted prefill has new ids. A
health check that fails drops it too, and so does the first that passes after
one failed (health.py): either may be a restart no request saw, and the pass
asks for the new map at once, in the background.

The key is the Endpoint object, not its address: an instance removed and added
again (admin.py), or a dns+ address that left the answer and came back, is a new
Endpoint, so a new server at an old address starts with no map of the old one's.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from functools import partial
from typing import Callable

from ..config.settings import EndpointSpec
from ..timeouts import deadline
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Upstream, UpstreamError
from .backend_json import MAX_QUERY_ANSWER_BYTES, BadAnswer, query_engine_ids

QUERY_TIMEOUT_SECONDS = 5.0  # as llm-d's sidecar and vLLM's own bound
CACHE_ENTRIES = 1024
MAX_ANSWER_BYTES = MAX_QUERY_ANSWER_BYTES


class BootstrapError(Exception):
    pass


class EngineMap:
    """One prefill endpoint's ranks and engine ids, and whose turn is next."""

    __slots__ = ("ranks", "engine_ids", "bootstrap_addr", "_turn")

    def __init__(self, engines: dict[str, str]) -> None:
        self.ranks = sorted(engines, key=lambda rank: (len(rank), rank))
        self.engine_ids = engines
        self.bootstrap_addr = ""  # decode's remote_bootstrap_addr, set once it is cached
        self._turn = 0

    def next_rank(self) -> tuple[str, str]:
        """Spread prefill load over the ranks, in turn."""
        rank = self.ranks[self._turn % len(self.ranks)]
        self._turn += 1
        return rank, self.engine_ids[rank]


def parse_query_answer(raw: bytes) -> dict[str, str]:
    """The answer's {rank: engine_id}, checked by backend_json; BootstrapError if unusable.

    A bad answer raises before _query stores anything: it is never cached, and
    the next request queries again.
    """
    try:
        return query_engine_ids(raw)
    except BadAnswer as exc:
        raise BootstrapError(f"unusable answer: {exc}") from None


class BootstrapCache:
    """The engine maps of the prefill endpoints, and the queries that learn them.

    ``on_query(seconds, "ok" | "error")`` is told of every query that ended.
    """

    def __init__(self, upstream: Upstream, default_port: int,
                 on_query: Callable[[float, str], None] | None = None) -> None:
        self.upstream = upstream
        self.default_port = default_port
        self._maps: OrderedDict[Endpoint, EngineMap] = OrderedDict()
        self._queries: dict[Endpoint, asyncio.Future[EngineMap]] = {}
        # Bootstrap servers are plain-HTTP endpoints of their own (pooled like any).
        self._servers: OrderedDict[str, Endpoint] = OrderedDict()
        self._on_query = on_query

    def __len__(self) -> int:
        return len(self._maps)

    def servers(self) -> list[Endpoint]:
        return list(self._servers.values())

    def bootstrap_port(self, endpoint: Endpoint) -> int:
        return endpoint.spec.bootstrap_port or self.default_port

    def bootstrap_addr(self, endpoint: Endpoint) -> str:
        host = endpoint.bootstrap_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.bootstrap_port(endpoint)}"

    def forget(self, endpoint: Endpoint) -> None:
        """Drop the endpoint's map: a prefill leg to it failed, or a health check did.

        A query under way is disowned: its answer may come from the server that
        is going away, so it serves only the requests already waiting for it and
        is not kept; the next request asks again.
        """
        self._maps.pop(endpoint, None)
        self._queries.pop(endpoint, None)

    def health_checked(self, endpoint: Endpoint, passed: bool) -> None:
        """A health check of the prefill ``endpoint`` failed, or passed after one failed.

        Either may be a restart (new engine ids), so what the endpoint answered
        before is dropped. After a pass the server is back: its map is asked for
        now, so that the next request finds it (or waits on this query) rather
        than being told the ids of the engine that went away.
        """
        self.forget(endpoint)
        if passed:
            self._start_query(endpoint)

    def cached(self, endpoint: Endpoint) -> EngineMap | None:
        """The endpoint's engine map if it is cached (nearly always): no coroutine to await."""
        cached = self._maps.get(endpoint)
        if cached is not None:
            self._maps.move_to_end(endpoint)
        return cached

    async def engines(self, endpoint: Endpoint) -> EngineMap:
        """The endpoint's engine map, from the cache or one (shared) query."""
        cached = self.cached(endpoint)
        if cached is not None:
            return cached
        pending = self._queries.get(endpoint)
        if pending is None:
            pending = self._start_query(endpoint)
        # Shielded: one client leaving must not cancel a query others wait on.
        return await asyncio.shield(pending)

    def _start_query(self, endpoint: Endpoint) -> asyncio.Future[EngineMap]:
        pending = asyncio.ensure_future(self._query(endpoint))
        self._queries[endpoint] = pending
        pending.add_done_callback(partial(self._query_done, endpoint))
        return pending

    def _owns(self, endpoint: Endpoint) -> bool:
        """Whether the running query is still the endpoint's (forget() disowns it)."""
        return self._queries.get(endpoint) is asyncio.current_task()

    def _query_done(self, endpoint: Endpoint, future: asyncio.Future[EngineMap]) -> None:
        if self._queries.get(endpoint) is future:
            del self._queries[endpoint]
        # Every waiter may have left (clients gone) before a failed query ended:
        # its error is then nobody's, and asyncio would print it with a traceback
        # at collection. Each waiter that stayed raises it from shield() itself.
        if not future.cancelled():
            future.exception()

    async def _query(self, endpoint: Endpoint) -> EngineMap:
        loop = asyncio.get_running_loop()
        started = loop.time()
        ok = False
        try:
            async with deadline(QUERY_TIMEOUT_SECONDS):
                engine_map = await self._fetch(endpoint)
            ok = True
        except TimeoutError:
            raise BootstrapError(f"{self.bootstrap_addr(endpoint)}/query did not answer "
                                 f"within {QUERY_TIMEOUT_SECONDS:g}s") from None
        finally:
            if self._on_query is not None:
                self._on_query(loop.time() - started, "ok" if ok else "error")
        engine_map.bootstrap_addr = self.bootstrap_addr(endpoint)  # once, not per request
        if not self._owns(endpoint):
            return engine_map  # forgotten meanwhile: for its waiters only
        self._maps[endpoint] = engine_map
        while len(self._maps) > CACHE_ENTRIES:
            self._maps.popitem(last=False)
        return engine_map

    async def _fetch(self, endpoint: Endpoint) -> EngineMap:
        address = f"{endpoint.bootstrap_host}:{self.bootstrap_port(endpoint)}"
        server = self._servers.get(address)
        if server is None:
            server = Endpoint(EndpointSpec("http", endpoint.bootstrap_host,
                                           self.bootstrap_port(endpoint)))
            self._servers[address] = server
            while len(self._servers) > CACHE_ENTRIES:
                _, evicted = self._servers.popitem(last=False)
                self.upstream.close_idle(evicted)
        try:
            response = await self.upstream.request(server, b"GET", b"/query",
                                                   [(b"accept", b"application/json")], None)
        except UpstreamError as exc:
            raise BootstrapError(f"{self.bootstrap_addr(endpoint)}/query: {exc}") from None
        try:
            if not 200 <= response.status < 300:
                raise BootstrapError(f"{self.bootstrap_addr(endpoint)}/query answered "
                                     f"{response.status}")
            try:
                raw = await response.read(MAX_ANSWER_BYTES)
            except UpstreamError as exc:
                raise BootstrapError(str(exc)) from None
        finally:
            await response.aclose()
        try:
            return EngineMap(parse_query_answer(raw))
        except BootstrapError as exc:
            raise BootstrapError(f"{self.bootstrap_addr(endpoint)}/query: {exc}") from None
