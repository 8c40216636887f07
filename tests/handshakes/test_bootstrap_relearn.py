"""A prefill replaced at the same address: its Mooncake engine map is learned again.

vLLM's engine ids are new uuids on every start. The demo prefill keeps the KV
under the engine id of the rank that computed it and the demo decode fails
(500) when told another one, as a real decode fails or waits out its KV
timeout: so a stale map shows as a 500 to the client, a fresh one as a 200
whose decode leg names the new engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from helpers import CHAT, chat, config_for, pd_setup, running_proxy, wait_until
from lowproxy.config import parse_endpoint
from lowproxy.demo import DemoBackend, start_pair
from lowproxy.handshakes import bootstrap
from lowproxy.handshakes.bootstrap import BootstrapCache, BootstrapError, EngineMap
from lowproxy.upstream import Endpoint

ADMIN = [("x-admin-api-key", "adm")]


def engine_told_to_decode(decode: DemoBackend) -> str:
    return decode.requests_to("/chat/completions")[-1].body["kv_transfer_params"][
        "remote_engine_id"]


async def replaced(prefill: DemoBackend) -> DemoBackend:
    """The prefill stopped and a new one started on its two ports: new engine ids."""
    await prefill.close()
    fresh = DemoBackend("prefill", registry=prefill.registry)
    return await fresh.start(port=prefill.port, bootstrap_port=prefill.bootstrap_port)


@contextlib.asynccontextmanager
async def pair() -> AsyncIterator[tuple[list[DemoBackend], DemoBackend]]:
    """[prefill] (the test may swap in its replacement) and decode, closed after."""
    prefill, decode = await start_pair()
    prefills = [prefill]
    try:
        yield prefills, decode
    finally:
        for backend in (*prefills, decode):
            await backend.close()


async def served_by(proxy: Any, prefill: DemoBackend, decode: DemoBackend) -> None:
    reply = await proxy.request("POST", CHAT, chat())
    assert reply.status == 200, reply.body  # a stale engine id makes decode fail
    assert engine_told_to_decode(decode) == prefill.engine_ids["0"]


# -- (b) a new Endpoint, a new map


async def test_an_instance_removed_and_added_again_at_its_address_is_queried_anew():
    async with pair() as (prefills, decode):
        instance = f"{prefills[0].url}#bootstrap_port={prefills[0].bootstrap_port}"
        config = config_for(instance, decode.url, kv_protocol="mooncake", admin_api_key="adm")
        async with running_proxy(config) as proxy:
            await served_by(proxy, prefills[0], decode)
            body = {"type": "prefill", "instance": instance}
            assert (await proxy.request("POST", "/instances/remove", body,
                                        headers=ADMIN)).status == 200
            prefills[0] = await replaced(prefills[0])
            assert (await proxy.request("POST", "/instances/add", body,
                                        headers=ADMIN)).status == 200
            await served_by(proxy, prefills[0], decode)
            assert prefills[0].bootstrap_queries == 1


class Resolver:
    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)

    async def __call__(self, host: str, port: int) -> list[str]:
        return list(self.addresses)


async def test_a_dns_address_that_left_and_came_back_is_queried_anew():
    """A pod went away and a new one got its address (a headless Service's answer)."""
    async with pair() as (prefills, decode):
        resolver = Resolver("127.0.0.1")
        config = config_for(f"dns+http://prefill.svc:{prefills[0].port}"
                            f"#bootstrap_port={prefills[0].bootstrap_port}", decode.url,
                            kv_protocol="mooncake")
        async with running_proxy(config, resolver=resolver) as proxy:
            await served_by(proxy, prefills[0], decode)
            resolver.addresses = []
            await proxy.proxy.refresh_discovery()
            prefills[0] = await replaced(prefills[0])
            resolver.addresses = ["127.0.0.1"]
            await proxy.proxy.refresh_discovery()
            await served_by(proxy, prefills[0], decode)
            assert prefills[0].bootstrap_queries == 1


# -- (a) a restart the health checks saw


async def test_a_prefill_whose_check_failed_then_passed_is_queried_anew():
    """It went out and came back (a restart) while no request reached it."""
    async with pd_setup("mooncake", health_interval=0.05) as (proxy, prefill, decode):
        await served_by(proxy, prefill, decode)
        [endpoint] = proxy.proxy.prefill.endpoints
        checks = proxy.proxy.prefill.failed_checks
        prefill.dead = "restarting"  # /health answers 503
        await wait_until(lambda: checks.get(endpoint), what="a failed check")
        assert len(proxy.proxy.bootstrap) == 0  # dropped: it may be restarting
        prefill.restart_engines()  # back, with new engine ids
        await wait_until(lambda: checks.get(endpoint) == 0, what="a passing check")
        # The pass asked for the new map at once: no request waits for it.
        await wait_until(lambda: len(proxy.proxy.bootstrap) == 1, what="the new map")
        await served_by(proxy, prefill, decode)
        # Checks that pass after a pass ask nothing.
        checked = len(prefill.requests_to("/health"))
        await wait_until(lambda: len(prefill.requests_to("/health")) >= checked + 3,
                         what="three more checks")
        assert prefill.bootstrap_queries == 2


# -- (c) a restart nothing saw: the map in use is asked for again


async def test_a_restart_no_check_and_no_request_saw_is_learned_within_the_refresh_period(
        monkeypatch):
    monkeypatch.setattr(bootstrap, "REFRESH_SECONDS", 0.2)
    async with pd_setup("mooncake") as (proxy, prefill, decode):  # health checks off
        await served_by(proxy, prefill, decode)
        await served_by(proxy, prefill, decode)  # read from the cache: in use
        prefill.restart_engines()  # a fast restart: nothing failed
        await wait_until(lambda: prefill.bootstrap_queries == 2, what="the refresh")
        await wait_until(lambda: proxy.proxy.bootstrap.cached(proxy.proxy.prefill.endpoints[0])
                         .engine_ids == prefill.engine_ids, what="the new map kept")
        await served_by(proxy, prefill, decode)
        assert prefill.bootstrap_queries == 2  # the request did not ask: it was learned


# -- units: the cache's own rules


class GatedQueries:
    """Stands in for BootstrapCache._fetch: each query answers the current engine id
    once the gate opens."""

    def __init__(self) -> None:
        self.engine = "a"
        self.calls = 0
        self.fail = False
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, endpoint: Endpoint) -> EngineMap:
        self.calls += 1
        engine = self.engine
        await self.gate.wait()
        if self.fail:
            raise BootstrapError("down")
        return EngineMap({"0": engine})


def gated_cache(monkeypatch: Any) -> tuple[BootstrapCache, GatedQueries, Endpoint]:
    cache = BootstrapCache(upstream=None, default_port=8998)  # type: ignore[arg-type]
    fake = GatedQueries()
    monkeypatch.setattr(cache, "_fetch", fake)
    return cache, fake, Endpoint(parse_endpoint("http://p:1"))


async def test_a_query_under_way_when_the_map_is_forgotten_is_not_kept(monkeypatch):
    cache, fake, endpoint = gated_cache(monkeypatch)
    fake.gate.clear()
    waiting = asyncio.ensure_future(cache.engines(endpoint))
    await asyncio.sleep(0)
    cache.forget(endpoint)  # a check failed while the old server was being asked
    fake.gate.set()
    assert (await waiting).engine_ids == {"0": "a"}  # its waiter still has an answer
    assert cache.cached(endpoint) is None
    fake.engine = "b"
    assert (await cache.engines(endpoint)).engine_ids == {"0": "b"}
    assert fake.calls == 2


async def test_a_check_passing_after_a_failure_asks_at_once(monkeypatch):
    cache, fake, endpoint = gated_cache(monkeypatch)
    await cache.engines(endpoint)
    cache.health_checked(endpoint, passed=False)
    assert cache.cached(endpoint) is None and fake.calls == 1  # nothing asked of it
    fake.engine = "b"
    cache.health_checked(endpoint, passed=True)
    await asyncio.sleep(0)
    assert fake.calls == 2
    assert (await cache.engines(endpoint)).engine_ids == {"0": "b"} and fake.calls == 2


async def test_a_refresh_serves_the_old_map_until_the_new_one_answers(monkeypatch):
    monkeypatch.setattr(bootstrap, "REFRESH_SECONDS", 0.05)
    cache, fake, endpoint = gated_cache(monkeypatch)
    await cache.engines(endpoint)
    old = cache.cached(endpoint)  # read by a request: kept fresh
    fake.gate.clear()
    fake.engine = "b"  # it restarted
    await wait_until(lambda: fake.calls == 2, what="the refresh")
    # Under way: requests neither wait nor are told nothing.
    assert cache.cached(endpoint) is old
    assert await asyncio.wait_for(cache.engines(endpoint), 0.01) is old
    fake.gate.set()
    await wait_until(lambda: cache.cached(endpoint).engine_ids == {"0": "b"},
                     what="the new map")
    await cache.close()


async def test_a_refresh_that_answers_the_same_keeps_the_turn_over_the_ranks(monkeypatch):
    monkeypatch.setattr(bootstrap, "REFRESH_SECONDS", 0.05)
    cache, fake, endpoint = gated_cache(monkeypatch)
    engines = await cache.engines(endpoint)
    assert cache.cached(endpoint) is engines
    await wait_until(lambda: fake.calls == 2, what="the refresh")
    await asyncio.sleep(0)
    assert cache.cached(endpoint) is engines
    await cache.close()


async def test_a_map_no_request_read_is_dropped_not_refreshed(monkeypatch):
    monkeypatch.setattr(bootstrap, "REFRESH_SECONDS", 0.05)
    cache, fake, endpoint = gated_cache(monkeypatch)
    await cache.engines(endpoint)  # the query's own waiter: not a read of the cache
    await wait_until(lambda: len(cache) == 0, what="the map dropped")
    assert fake.calls == 1


async def test_a_refresh_that_fails_drops_the_map(monkeypatch):
    monkeypatch.setattr(bootstrap, "REFRESH_SECONDS", 0.05)
    cache, fake, endpoint = gated_cache(monkeypatch)
    await cache.engines(endpoint)
    cache.cached(endpoint)
    fake.fail = True
    await wait_until(lambda: len(cache) == 0, what="the map dropped")
    assert fake.calls == 2
