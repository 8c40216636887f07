"""A Mooncake bootstrap query that failed is held for a moment (bootstrap.HOLD_SECONDS).

A bootstrap server that accepts and never answers used to cost every request
the whole query bound (5 s), each with a query of its own. Now one query fails,
requests for that prefill are answered its failure at once (decode computes the
prompt) or go to another prefill, and the server is asked again in the
background.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from helpers import CHAT, RawServer, chat, config_for, running_proxy, wait_until
from lowproxy.config import parse_endpoint
from lowproxy.demo import DemoBackend, start_pair
from lowproxy.handshakes import bootstrap
from lowproxy.handshakes.bootstrap import BootstrapCache, BootstrapError, EngineMap
from lowproxy.upstream import Endpoint


class HungBootstrap(RawServer):
    """A bootstrap server that reads each query and never answers it."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    number: int) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /query "):
                self.queries += 1


async def timed(proxy: Any) -> float:
    started = time.monotonic()
    reply = await proxy.request("POST", CHAT, chat())
    assert reply.status == 200, reply.body  # decode computed the prompt
    return time.monotonic() - started


async def test_a_hung_bootstrap_server_delays_one_query_not_every_request(monkeypatch):
    monkeypatch.setattr(bootstrap, "QUERY_TIMEOUT_SECONDS", 0.5)
    monkeypatch.setattr(bootstrap, "HOLD_SECONDS", 0.5)
    hung = await HungBootstrap().start()
    prefill, decode = await start_pair()
    config = config_for(f"{prefill.url}#bootstrap_port={hung.port}", decode.url,
                        kv_protocol="mooncake")
    try:
        async with running_proxy(config) as proxy:
            # Requests at once share one query and wait out its bound.
            waited = await asyncio.gather(*(timed(proxy) for _ in range(4)))
            assert min(waited) >= 0.5 and hung.queries == 1
            # Held: the next ones neither wait nor ask.
            for _ in range(3):
                assert await timed(proxy) < 0.25
            assert hung.queries == 1
            # Past the hold one asks again, in the background: it does not wait either.
            await asyncio.sleep(0.5)
            assert await timed(proxy) < 0.25
            await wait_until(lambda: hung.queries == 2, what="asked again")
            assert await timed(proxy) < 0.25  # while that query hangs
            assert prefill.requests_to("/chat/completions") == []  # no leg without an id
            metrics = proxy.proxy.metrics
            assert metrics.prefill_legs.get("mooncake", "recompute") == 9
            assert metrics.bootstrap_duration.count("error") == 1
    finally:
        await prefill.close()
        await decode.close()
        await hung.close()


async def test_while_a_failure_is_held_another_prefill_takes_the_requests(monkeypatch):
    monkeypatch.setattr(bootstrap, "QUERY_TIMEOUT_SECONDS", 0.3)
    monkeypatch.setattr(bootstrap, "HOLD_SECONDS", 30.0)  # the whole test
    hung = await HungBootstrap().start()
    stuck, decode = await start_pair()
    other = await DemoBackend("prefill", registry=decode.registry).start()
    config = config_for([f"{stuck.url}#bootstrap_port={hung.port}",
                         f"{other.url}#bootstrap_port={other.bootstrap_port}"], decode.url,
                        kv_protocol="mooncake")  # round robin: the stuck one first
    try:
        async with running_proxy(config) as proxy:
            await timed(proxy)  # the stuck prefill's query fails
            assert "kv_transfer_params" not in decode.requests_to("/chat/completions")[0].body
            for _ in range(4):
                await timed(proxy)
            # Every one went to the other prefill, with its KV, as routing
            # prefers an endpoint not cooling down.
            assert len(other.requests_to("/chat/completions")) == 4
            for leg in decode.requests_to("/chat/completions")[1:]:
                assert leg.body["kv_transfer_params"]["remote_engine_id"] == \
                    other.engine_ids["0"]
            assert stuck.requests_to("/chat/completions") == [] and hung.queries == 1
            listed = proxy.proxy.instances.listing()["prefill"]
            assert [entry["state"] for entry in listed] == ["cooling down", "usable"]
    finally:
        for backend in (stuck, other, decode):
            await backend.close()
        await hung.close()


# -- units: the hold's rules


class Queries:
    """Stands in for BootstrapCache._fetch: fails or answers on cue, once the gate opens."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = True
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, endpoint: Endpoint) -> EngineMap:
        self.calls += 1
        await self.gate.wait()
        if self.fail:
            raise BootstrapError("down")
        return EngineMap({"0": "e"})


def cache_with(monkeypatch: Any, hold: float) -> tuple[BootstrapCache, Queries, Endpoint]:
    monkeypatch.setattr(bootstrap, "HOLD_SECONDS", hold)
    cache = BootstrapCache(upstream=None, default_port=8998)  # type: ignore[arg-type]
    fake = Queries()
    monkeypatch.setattr(cache, "_fetch", fake)
    return cache, fake, Endpoint(parse_endpoint("http://p:1"))


async def test_a_failure_is_held_and_cools_the_endpoint_down(monkeypatch):
    cache, fake, endpoint = cache_with(monkeypatch, hold=30.0)
    with pytest.raises(BootstrapError):
        await cache.engines(endpoint)
    assert not endpoint.usable(time.monotonic())
    assert endpoint.cooldown_until == pytest.approx(time.monotonic() + 30.0, abs=1.0)
    fake.fail = False
    for _ in range(3):
        with pytest.raises(BootstrapError, match="held"):
            await cache.engines(endpoint)
    assert fake.calls == 1


async def test_past_the_hold_a_query_goes_out_unawaited_and_its_answer_lifts_the_cooldown(
        monkeypatch):
    cache, fake, endpoint = cache_with(monkeypatch, hold=0.0)
    with pytest.raises(BootstrapError):
        await cache.engines(endpoint)
    fake.fail = False
    fake.gate.clear()  # the query that goes out now hangs until the gate opens
    with pytest.raises(BootstrapError, match="held"):
        await cache.engines(endpoint)
    await asyncio.sleep(0)
    assert fake.calls == 2
    # While it is under way the endpoint is cooled down for as long as it may take.
    assert endpoint.cooldown_until > time.monotonic() + bootstrap.QUERY_TIMEOUT_SECONDS - 1
    with pytest.raises(BootstrapError, match="held"):
        await asyncio.wait_for(cache.engines(endpoint), 0.01)  # not waited on
    fake.gate.set()
    await wait_until(lambda: cache.cached(endpoint) is not None, what="the answer")
    assert endpoint.cooldown_until == 0.0 and fake.calls == 2


async def test_a_cooldown_set_since_the_hold_is_not_lifted(monkeypatch):
    cache, fake, endpoint = cache_with(monkeypatch, hold=0.0)
    with pytest.raises(BootstrapError):
        await cache.engines(endpoint)
    fake.fail = False
    with pytest.raises(BootstrapError):
        await cache.engines(endpoint)  # asks in the background
    refused_until = endpoint.cooldown_until = time.monotonic() + 60  # a refused connection
    await wait_until(lambda: cache.cached(endpoint) is not None, what="the answer")
    assert endpoint.cooldown_until == refused_until


async def test_a_check_passing_after_a_failure_ends_the_hold(monkeypatch):
    """The server answers its health check again: worth a wait, unlike a held failure."""
    cache, fake, endpoint = cache_with(monkeypatch, hold=30.0)
    with pytest.raises(BootstrapError):
        await cache.engines(endpoint)
    fake.fail = False
    cache.health_checked(endpoint, passed=True)
    assert (await cache.engines(endpoint)).engine_ids == {"0": "e"}
    assert fake.calls == 2 and endpoint.cooldown_until == 0.0
