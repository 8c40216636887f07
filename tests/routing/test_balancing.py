"""Several backends: decode least-loaded, prefill round robin, cooldown, dns+ discovery."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time

import pytest
import trustme

from helpers import CHAT, chat, config_for, demo_backends, running_proxy, wait_until
from lowproxy.demo import DemoBackend, KvRegistry
from lowproxy.routing import groups as backends


def served(backend: DemoBackend) -> int:
    return len(backend.requests_to("/chat/completions"))


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_decode_ties_go_round_robin():
    async with demo_backends(2) as (a, b):
        async with running_proxy(config_for((), [a.url, b.url])) as proxy:
            for _ in range(6):
                assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert served(a) == served(b) == 3


async def test_decode_goes_to_the_endpoint_with_fewest_requests_in_flight():
    async with demo_backends(2) as (a, b):
        a.faults.hang = b.faults.hang = True
        async with running_proxy(config_for((), [a.url, b.url])) as proxy:
            held = asyncio.ensure_future(proxy.request("POST", CHAT, chat(), timeout=30))
            await wait_until(lambda: served(a) + served(b) == 1, what="first request held")
            busy, idle = (a, b) if served(a) else (b, a)
            idle.faults.hang = False
            for _ in range(4):  # round robin would send one of these to the busy one
                assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert served(busy) == 1 and served(idle) == 4
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await held
            await wait_until(lambda: busy.abandoned == 1, what="held request closed")


async def test_concurrent_streams_spread_over_decode_backends():
    async with demo_backends(2, stream_chunks=5, chunk_delay=0.05) as (a, b):
        async with running_proxy(config_for((), [a.url, b.url])) as proxy:
            replies = await asyncio.gather(*(proxy.request("POST", CHAT, chat(stream=True))
                                             for _ in range(6)))
            assert all(r.status == 200 and r.complete for r in replies)
            assert served(a) == served(b) == 3


async def test_prefill_round_robin_over_endpoint_and_rank_pairs():
    registry = KvRegistry()
    prefills = [await DemoBackend("prefill", ranks=2, registry=registry).start()
                for _ in range(2)]
    decode = await DemoBackend("decode", registry=registry).start(bootstrap_port=None)
    try:
        urls = [f"{p.url}#bootstrap_port={p.bootstrap_port}" for p in prefills]
        async with running_proxy(config_for(urls, decode.url, kv_protocol="mooncake")) as proxy:
            for _ in range(8):
                reply = await proxy.request("POST", CHAT, chat())
                assert reply.status == 200, reply.body  # decode checks the engine id
        pairs = [(i, r.header("x-data-parallel-rank"))
                 for i, p in enumerate(prefills) for r in p.requests_to("/chat/completions")]
        assert sorted(pairs) == sorted([(i, rank) for i in (0, 1) for rank in (b"0", b"1")] * 2)
        engines = {e for p in prefills for e in p.engine_ids.values()}
        addrs = {f"http://127.0.0.1:{p.bootstrap_port}" for p in prefills}
        used = {(d.body["kv_transfer_params"]["remote_engine_id"],
                 d.body["kv_transfer_params"]["remote_bootstrap_addr"])
                for d in decode.requests_to("/chat/completions")}
        assert {e for e, _ in used} == engines and {a for _, a in used} == addrs
        assert [p.bootstrap_queries for p in prefills] == [1, 1]
    finally:
        for backend in (*prefills, decode):
            await backend.close()


async def test_dead_decode_is_cooled_down_while_another_serves():
    dead = f"http://127.0.0.1:{closed_port()}"
    async with demo_backends(1) as (live,):
        async with running_proxy(config_for((), [dead, live.url])) as proxy:
            for _ in range(4):
                reply = await proxy.request("POST", CHAT, chat())
                assert reply.status == 200, reply.body  # failed over, nothing was sent
            assert served(live) == 4
            group = proxy.proxy.decode
            assert group.in_cooldown() == 1
            [cooling] = [e for e in group.endpoints if not e.usable(time.monotonic())]
            assert cooling.label == dead
            metrics = (await proxy.request("GET", "/metrics")).body
            assert b'lowproxy_endpoints_in_cooldown{role="decode"} 1' in metrics


async def test_cooled_down_endpoint_is_tried_again_after_the_cooldown(monkeypatch):
    monkeypatch.setattr(backends, "COOLDOWN_SECONDS", 0.2)
    port = closed_port()
    async with demo_backends(1) as (live,):
        config = config_for((), [f"http://127.0.0.1:{port}", live.url])
        async with running_proxy(config) as proxy:
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert proxy.proxy.decode.in_cooldown() == 1
            revived = await DemoBackend("decode").start(port=port, bootstrap_port=None)
            try:
                await wait_until(lambda: proxy.proxy.decode.in_cooldown() == 0,
                                 what="cooldown over")
                for _ in range(4):
                    assert (await proxy.request("POST", CHAT, chat())).status == 200
                assert served(revived) == 2 and served(live) == 3
            finally:
                await revived.close()


async def test_dead_prefill_is_cooled_down_while_another_serves():
    dead = f"http://127.0.0.1:{closed_port()}"
    registry = KvRegistry()
    live = await DemoBackend("prefill", registry=registry).start(bootstrap_port=None)
    decode = await DemoBackend("decode", registry=registry).start(bootstrap_port=None)
    try:
        async with running_proxy(config_for([dead, live.url], decode.url)) as proxy:
            for _ in range(5):
                assert (await proxy.request("POST", CHAT, chat())).status == 200
            # The first request went to the dead prefill and recomputed; the rest used KV.
            assert served(live) == 4
            with_kv = [d for d in decode.requests_to("/chat/completions")
                       if "kv_transfer_params" in d.body]
            assert len(with_kv) == 4
            assert proxy.proxy.prefill.in_cooldown() == 1
    finally:
        await live.close()
        await decode.close()


async def test_no_decode_left_is_the_no_decode_answer():
    dead = [f"http://127.0.0.1:{closed_port()}" for _ in range(2)]
    async with running_proxy(config_for((), dead)) as proxy:
        for _ in range(2):  # first: both refuse; then: both cooling down
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 503
            assert reply.json()["error"]["type"] == "no_decode_backend"
        assert proxy.proxy.decode.in_cooldown() == 2


# -- dns+ discovery


def shared_port(hosts: tuple[str, ...]) -> int:
    """A port free on every one of the loopback addresses."""
    for _ in range(50):
        port = closed_port()
        try:
            for host in hosts:
                with socket.socket() as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError("no shared free port")


@contextlib.asynccontextmanager
async def two_addresses(**kw):
    """Decode backends on 127.0.0.1 and 127.0.0.2, one port: one Service, two pods."""
    hosts = ("127.0.0.1", "127.0.0.2")
    try:
        socket.create_server(("127.0.0.2", 0)).close()
    except OSError:  # pragma: no cover - environmental
        pytest.skip("127.0.0.2 is not usable on this host's loopback")
    port = shared_port(hosts)
    started = []
    try:
        for host in hosts:
            backend = DemoBackend("decode", **kw)
            await backend.start(host, port, bootstrap_port=None)
            started.append(backend)
        yield port, started
    finally:
        for backend in started:
            await backend.close()


class Resolver:
    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.calls: list[tuple[str, int]] = []
        self.fail = False
        self.no_such_name = False

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        if self.no_such_name:  # what getaddrinfo raises for NXDOMAIN
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if self.fail:
            raise OSError("resolver down")
        return list(self.addresses)


async def test_dns_discovery_balances_over_every_address_and_follows_changes():
    async with two_addresses() as (port, (one, two)):
        resolver = Resolver("127.0.0.1", "127.0.0.2")
        config = config_for((), f"dns+http://decode.svc:{port}")
        async with running_proxy(config, resolver=resolver) as proxy:
            assert resolver.calls == [("decode.svc", port)]
            for _ in range(4):
                assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert served(one) == served(two) == 2
            # The Host header names the service, whichever address served it.
            assert {r.header("host") for b in (one, two) for r in b.received} == \
                {f"decode.svc:{port}".encode()}

            resolver.addresses = ["127.0.0.2"]  # a pod went away
            await proxy.proxy.refresh_discovery()
            for _ in range(3):
                assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert served(one) == 2 and served(two) == 5

            resolver.fail = True  # a failed lookup keeps the last good answer
            await proxy.proxy.refresh_discovery()
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert served(two) == 6


async def test_a_name_that_stops_existing_resolves_to_nothing_and_in_use_pools_retire(caplog):
    """NXDOMAIN (CoreDNS's answer for a headless Service with no ready pod) is an
    answer, not a resolver failing: the last addresses are dropped (pod IPs may be
    reused), where a failing resolver keeps them, said once per streak. An address
    that leaves while a request is on it finishes there, and its connection is then
    closed by the sweep (it stayed open until the backend closed it)."""
    caplog.set_level(logging.INFO, logger="lowproxy")
    async with two_addresses() as (port, (one, two)):
        resolver = Resolver("127.0.0.1", "127.0.0.2")
        config = config_for((), f"dns+http://decode.svc:{port}")
        async with running_proxy(config, resolver=resolver) as proxy:
            group = proxy.proxy.decode
            leaving = next(e for e in group.endpoints if e.connect_host == "127.0.0.2")
            one.faults.delay = two.faults.delay = 1.0
            slow = [asyncio.create_task(proxy.request("POST", CHAT, chat())) for _ in range(2)]
            await wait_until(lambda: leaving.in_flight == 1, 5, "a request on 127.0.0.2")
            resolver.addresses = ["127.0.0.1"]
            await proxy.proxy.refresh_discovery()
            assert leaving in group.retired and leaving.open == 1  # in use: kept
            assert all(reply.status == 200 for reply in await asyncio.gather(*slow))
            await proxy.proxy.refresh_discovery()  # the sweep closes what it left
            assert leaving not in group.retired and leaving.open == 0

            resolver.fail = True
            for _ in range(3):
                await proxy.proxy.refresh_discovery()
            assert len(group.endpoints) == 1  # kept through a failing resolver
            assert sum("resolving" in r.getMessage() for r in caplog.records) == 1
            resolver.fail, resolver.no_such_name = False, True
            await proxy.proxy.refresh_discovery()
            assert group.endpoints == []
            assert (await proxy.request("GET", "/readyz")).json()["reason"] == \
                "no decode address resolved"


async def test_dns_names_are_re_resolved_every_refresh_period():
    async with two_addresses() as (port, (one, two)):
        resolver = Resolver("127.0.0.1")
        config = config_for((), f"dns+http://decode.svc:{port}", dns_refresh=0.1)
        async with running_proxy(config, resolver=resolver) as proxy:
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            resolver.addresses = ["127.0.0.2"]
            await wait_until(lambda: len(resolver.calls) >= 2, timeout=10,
                             what="a background re-resolution")
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert served(one) == 1 and served(two) == 1


async def test_dns_discovered_https_verifies_the_service_name(tmp_path):
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    for name, status in (("decode.svc", 200), ("other.svc", 503)):
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(name).configure_cert(context)  # the certificate names no address
        backend = DemoBackend("decode")
        await backend.server.listen("127.0.0.1", 0, ssl=context)
        backend.port = backend.server.ports[0]
        try:
            config = config_for((), f"dns+https://decode.svc:{backend.port}",
                                ca_file=str(ca_file))
            async with running_proxy(config, resolver=Resolver("127.0.0.1")) as proxy:
                reply = await proxy.request("POST", CHAT, chat())
                assert reply.status == status, (name, reply.body)
                assert served(backend) == (1 if status == 200 else 0)
        finally:
            await backend.close()


async def test_lone_prefill_in_cooldown_is_still_tried():
    """A cooldown only prefers the others: with none left, one refusal is no outage."""
    port = closed_port()
    registry = KvRegistry()
    decode = await DemoBackend("decode", registry=registry).start(bootstrap_port=None)
    prefill = DemoBackend("prefill", registry=registry)
    try:
        config = config_for(f"http://127.0.0.1:{port}", decode.url)
        async with running_proxy(config) as proxy:
            assert (await proxy.request("POST", CHAT, chat())).status == 200  # recomputed
            assert proxy.proxy.prefill.in_cooldown() == 1
            await prefill.start(port=port, bootstrap_port=None)
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert served(prefill) == 1  # tried during its cooldown
            first, second = decode.requests_to("/chat/completions")
            assert "kv_transfer_params" not in first.body and "kv_transfer_params" in second.body
    finally:
        await prefill.close()
        await decode.close()


async def test_lone_decode_in_cooldown_is_still_tried():
    port = closed_port()
    decode = DemoBackend("decode")
    try:
        async with running_proxy(config_for((), f"http://127.0.0.1:{port}")) as proxy:
            assert (await proxy.request("POST", CHAT, chat())).status == 503
            await decode.start(port=port, bootstrap_port=None)
            assert (await proxy.request("POST", CHAT, chat())).status == 200
    finally:
        await decode.close()


async def test_dns_names_resolving_to_nothing():
    async with demo_backends(1) as (decode,):
        resolver = Resolver()  # no address at all
        config = config_for("dns+http://prefill.svc:8000", decode.url)
        async with running_proxy(config, resolver=resolver) as proxy:
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 200  # no prefill to ask: decode computes the prompt
            assert "kv_transfer_params" not in decode.requests_to("/chat/completions")[0].body
        config = config_for((), "dns+http://decode.svc:8000")
        async with running_proxy(config, resolver=resolver) as proxy:
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 503 and reply.json()["error"]["type"] == "no_decode_backend"


async def test_a_dns_name_resolving_to_nothing_says_so_in_readyz_and_the_answer(caplog):
    """The shipped manifest's decode is a headless Service: before any vLLM pod is
    ready it resolves to nothing, and /readyz said "decode not checked yet" for
    ever (session 36's docs audit)."""
    resolver = Resolver()
    config = config_for((), "dns+http://decode.svc:8000", health_interval=0.2)
    async with running_proxy(config, resolver=resolver) as proxy:
        ready = await proxy.request("GET", "/readyz")
        assert ready.status == 503 and ready.json()["reason"] == "no decode address resolved"
        assert (await proxy.request("POST", CHAT, chat())).status == 503
    assert any("dns+ name resolves to none" in record.getMessage()
               for record in caplog.records)


async def test_no_prefill_leg_while_the_decode_name_resolves_to_nothing():
    """Before any decode pod is ready, a prefill leg would compute a KV nobody reads."""
    async with demo_backends(1) as [prefill]:
        config = config_for(prefill.url, "dns+http://decode.svc:8000", health_interval=0.2)
        async with running_proxy(config, resolver=Resolver()) as proxy:
            assert (await proxy.request("POST", CHAT, chat())).status == 503
            assert prefill.requests_to("/chat/completions") == []
