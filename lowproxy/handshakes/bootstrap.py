"""The Mooncake bootstrap map: which engine id serves each data-parallel rank.

vLLM 0.16+ prefill runs a bootstrap server (rank 0 worker, plain HTTP) whose
``GET /query`` answers ``{"<rank>": {"engine_id": ...}, ...}``. Decode needs
the engine id of the rank that computed the KV. Engine ids are random per
start, so the answer is cached per prefill endpoint (bounded) and dropped
when a request to that endpoint fails: a restarted prefill has new ids. A
health check that fails drops it too, and so does the first that passes after
one failed (health.py): either may be a restart no request saw, and the pass
asks for the new map at once, in the background.

A map in use is asked for again REFRESH_SECONDS after it was learned, in the
background: requests go on with the map they have until the answer comes, and
a different answer is used from then on. That bounds how long decode can be
told the ids of an engine that restarted unseen (checks off, a scheduler-named
target, which is not checked, an address reused between two checks). A map no
request read for a whole period is dropped instead (an instance removed, a
target no longer named): its next request asks, as a first one does. A refresh
that fails drops the map as well: decode asks that same server where the
engine's workers are, so a map it cannot confirm is no use to a new request.

A query that fails (refused, unanswered within its bound, an unusable answer)
is held HOLD_SECONDS: requests for that endpoint are answered the failure at
once (decode computes the prompt, or the client gets the 502 under the error
policy) instead of each waiting on a query of its own, and the endpoint is
cooled down for as long (routing prefers other prefills; a prefill whose
server cannot answer can do no handshake). After the hold the next request
asks again in the background and still goes on without it, the endpoint
cooled down until that query ends: once a server has failed, no request waits
on it until it answers again. Requests that find no map and no failure share
one query, as before.

The key is the Endpoint object, not its address: an instance removed and added
again (admin.py), or a dns+ address that left the answer and came back, is a new
Endpoint, so a new server at an old address starts with no map of the old one's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from functools import partial
from typing import Callable, NoReturn

from ..config.settings import EndpointSpec
from ..timeouts import deadline
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Upstream, UpstreamError
from .backend_json import MAX_QUERY_ANSWER_BYTES, BadAnswer, query_engine_ids

QUERY_TIMEOUT_SECONDS = 5.0  # as llm-d's sidecar and vLLM's own bound
CACHE_ENTRIES = 1024
MAX_ANSWER_BYTES = MAX_QUERY_ANSWER_BYTES
# How long a map may go unconfirmed. Every request to a prefill that restarted
# unseen is lost until its map is learned again (decode waits for KV of an
# engine that is gone: up to 480 s), so seconds, not minutes; a query is a few
# hundred bytes, and one per prefill in use each 10 s is a quarter of what the
# health checks already send (two GETs each 5 s). vLLM takes tens of seconds to
# start, so a restart is nearly always seen first by a failed check or leg.
REFRESH_SECONDS = 10.0
# How long a failed query is answered without asking again: routing's cooldown
# of an endpoint that refused a connection (groups.COOLDOWN_SECONDS), so the two
# agree. A hung server then costs one bounded query, not one per request, and a
# prefill that is back is asked again by the first request 2 s after it failed.
HOLD_SECONDS = 2.0

log = logging.getLogger("lowproxy.bootstrap")


class BootstrapError(Exception):
    pass


class EngineMap:
    """One prefill endpoint's ranks and engine ids, and whose turn is next."""

    __slots__ = ("ranks", "engine_ids", "bootstrap_addr", "_turn", "used", "refresh")

    def __init__(self, engines: dict[str, str]) -> None:
        self.ranks = sorted(engines, key=lambda rank: (len(rank), rank))
        self.engine_ids = engines
        self.bootstrap_addr = ""  # decode's remote_bootstrap_addr, set once it is cached
        self._turn = 0
        self.used = False  # read by a request since its last refresh began
        self.refresh: asyncio.TimerHandle | None = None  # when it is asked for again

    def next_rank(self) -> tuple[str, str]:
        """Spread prefill load over the ranks, in turn."""
        rank = self.ranks[self._turn % len(self.ranks)]
        self._turn += 1
        return rank, self.engine_ids[rank]


class HeldFailure:
    """A failed query: answered to requests until ``until`` without asking again."""

    __slots__ = ("why", "until", "cooled_until")

    def __init__(self, why: str, until: float, cooled_until: float) -> None:
        self.why = why
        self.until = until  # time.monotonic(), as routing's cooldowns
        self.cooled_until = cooled_until  # the cooldown it set: lifted once a query answers


def parse_query_answer(raw: bytes) -> dict[str, str]:
    """The answer's {rank: engine_id}, checked by backend_json; BootstrapError if unusable.

    A bad answer raises before _query stores anything: it is never cached, and
    is held as any failed query is.
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
        self._running: set[asyncio.Future[EngineMap]] = set()  # disowned ones too
        self._held: OrderedDict[Endpoint, HeldFailure] = OrderedDict()
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
        self._drop(endpoint)
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
            self._release(endpoint)  # it answers again: worth a wait, unlike a held failure
            self._start_query(endpoint)

    def cached(self, endpoint: Endpoint) -> EngineMap | None:
        """The endpoint's engine map if it is cached (nearly always): no coroutine to await."""
        cached = self._maps.get(endpoint)
        if cached is not None:
            cached.used = True  # kept fresh (see _refresh_due); the bound goes by learning
        return cached

    async def engines(self, endpoint: Endpoint) -> EngineMap:
        """The endpoint's engine map, from the cache or one (shared) query."""
        cached = self.cached(endpoint)
        if cached is not None:
            return cached
        held = self._held.get(endpoint)
        if held is not None:
            self._answer_held(endpoint, held)
        pending = self._queries.get(endpoint)
        if pending is None:
            pending = self._start_query(endpoint)
        # Shielded: one client leaving must not cancel a query others wait on.
        return await asyncio.shield(pending)

    def _answer_held(self, endpoint: Endpoint, held: HeldFailure) -> NoReturn:
        """The held failure, at once; past the hold, a query in the background first."""
        now = time.monotonic()
        if now >= held.until and endpoint not in self._queries:
            # Not awaited: a server that hangs would hold this request the whole
            # bound. Routing prefers other prefills until this query has ended.
            endpoint.cooldown_until = max(endpoint.cooldown_until,
                                          now + QUERY_TIMEOUT_SECONDS)
            held.cooled_until = endpoint.cooldown_until
            self._start_query(endpoint)
        raise BootstrapError(f"{held.why} (held: no request waits on this server again "
                             f"until a query answers)")

    def _hold(self, endpoint: Endpoint, why: str) -> None:
        until = time.monotonic() + HOLD_SECONDS
        # Read by routing (groups.py): other prefills are preferred meanwhile.
        endpoint.cooldown_until = max(endpoint.cooldown_until, until)
        self._held[endpoint] = HeldFailure(why, until, endpoint.cooldown_until)
        self._held.move_to_end(endpoint)
        while len(self._held) > CACHE_ENTRIES:
            self._held.popitem(last=False)

    def _release(self, endpoint: Endpoint) -> None:
        """The endpoint's failure is no longer held; a cooldown the hold set is lifted."""
        held = self._held.pop(endpoint, None)
        if held is not None and endpoint.cooldown_until == held.cooled_until:
            endpoint.cooldown_until = 0.0  # not one a refused connection set since

    def _start_query(self, endpoint: Endpoint) -> asyncio.Future[EngineMap]:
        pending = asyncio.get_running_loop().create_task(self._query(endpoint))
        self._queries[endpoint] = pending
        self._running.add(pending)
        pending.add_done_callback(partial(self._query_done, endpoint))
        return pending

    def _owns(self, endpoint: Endpoint) -> bool:
        """Whether the running query is still the endpoint's (forget() disowns it)."""
        return self._queries.get(endpoint) is asyncio.current_task()

    def _query_done(self, endpoint: Endpoint, future: asyncio.Future[EngineMap]) -> None:
        self._running.discard(future)
        if self._queries.get(endpoint) is future:
            del self._queries[endpoint]
        # Every waiter may have left (clients gone) before a failed query ended:
        # its error is then nobody's, and asyncio would print it with a traceback
        # at collection. Each waiter that stayed raises it from shield() itself.
        if not future.cancelled():
            future.exception()

    async def _query(self, endpoint: Endpoint) -> EngineMap:
        try:
            engine_map = await self._timed_fetch(endpoint)
        except BootstrapError as exc:
            if self._owns(endpoint):
                if self._drop(endpoint):
                    log.warning("%s: refreshing the Mooncake engine map failed, dropped: %s",
                                endpoint.label, exc)
                self._hold(endpoint, str(exc))
            raise
        if not self._owns(endpoint):
            return engine_map  # forgotten meanwhile: for its waiters only
        return self._learned(endpoint, engine_map)

    async def _timed_fetch(self, endpoint: Endpoint) -> EngineMap:
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
        return engine_map

    def _learned(self, endpoint: Endpoint, fresh: EngineMap) -> EngineMap:
        """Keep what a query answered; the map requests read from now on."""
        self._release(endpoint)
        old = self._maps.pop(endpoint, None)
        if old is not None:
            if old.refresh is not None:
                old.refresh.cancel()
            if old.engine_ids == fresh.engine_ids:
                fresh = old  # the same start: its turn over the ranks goes on
            else:
                fresh.used = old.used
                log.info("%s answered new Mooncake engine ids (the prefill restarted): "
                         "used from now on", endpoint.label)
        self._maps[endpoint] = fresh  # last: the bound drops the least recently learned
        fresh.refresh = asyncio.get_running_loop().call_later(
            REFRESH_SECONDS, self._refresh_due, endpoint, fresh)
        while len(self._maps) > CACHE_ENTRIES:
            _, evicted = self._maps.popitem(last=False)
            if evicted.refresh is not None:
                evicted.refresh.cancel()
        return fresh

    def _refresh_due(self, endpoint: Endpoint, engine_map: EngineMap) -> None:
        """REFRESH_SECONDS after ``engine_map`` was learned: ask again, or let it go."""
        engine_map.refresh = None
        if self._maps.get(endpoint) is not engine_map:
            return
        if not engine_map.used:
            del self._maps[endpoint]  # nobody read it: nobody needs it kept fresh
            return
        engine_map.used = False
        if endpoint not in self._queries:
            self._start_query(endpoint)  # meanwhile requests read the map they have

    def _drop(self, endpoint: Endpoint) -> bool:
        """Drop the endpoint's map, if it has one (and its refresh)."""
        engine_map = self._maps.pop(endpoint, None)
        if engine_map is None:
            return False
        if engine_map.refresh is not None:
            engine_map.refresh.cancel()
        return True

    async def close(self) -> None:
        """No more refreshes; queries under way are cancelled."""
        for engine_map in self._maps.values():
            if engine_map.refresh is not None:
                engine_map.refresh.cancel()
        pending = list(self._running)
        self._queries.clear()
        for query in pending:
            query.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)

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
