"""Scheduler-chosen prefill targets (x-prefiller-host-port), honoured only inside the allowlist."""

from __future__ import annotations

import contextlib
import logging

from helpers import CHAT, chat, config_for, running_proxy
from lowproxy.demo import DemoBackend, KvRegistry

HEADER = "x-prefiller-host-port"


@contextlib.asynccontextmanager
async def cluster(allow_for=None, **overrides):
    """Configured prefill A, two more prefills B and C a scheduler may name, one decode.

    ``allow_for(b)`` gives the allowlist once B's port is known.
    """
    registry = KvRegistry()
    a, b, c = [await DemoBackend("prefill", registry=registry).start() for _ in range(3)]
    decode = await DemoBackend("decode", registry=registry).start(bootstrap_port=None)
    if allow_for is not None:
        overrides["prefill_header_allow"] = tuple(allow_for(b))
    try:
        config = config_for(a.url, decode.url, **overrides)
        async with running_proxy(config) as proxy:
            yield proxy, (a, b, c), decode
    finally:
        for backend in (a, b, c, decode):
            await backend.close()


def generations(backend: DemoBackend):
    return backend.requests_to("/chat/completions")


def no_header_reached(*backends: DemoBackend) -> bool:
    return all(r.header(HEADER) is None for backend in backends for r in backend.received)


async def test_allowed_target_gets_the_prefill_leg_and_never_the_header():
    async with cluster(prefill_header_allow=("127.0.0.0/8",)) as (proxy, (a, b, c), decode):
        reply = await proxy.request("POST", CHAT, chat(),
                                    headers=[(HEADER, f"127.0.0.1:{b.port}")])
        assert reply.status == 200, reply.body
        assert generations(a) == [] and len(generations(b)) == 1
        [dc] = generations(decode)
        assert dc.body["kv_transfer_params"]["remote_block_ids"]  # relayed from B
        assert no_header_reached(a, b, c, decode)


async def test_allowlist_entries_by_host_and_by_host_port():
    for allow in ("127.0.0.1", "127.0.0.1:{port}"):
        def allowed(b, allow=allow):
            return [allow.format(port=b.port)]

        async with cluster(allowed) as (proxy, (a, b, c), decode):
            reply = await proxy.request("POST", CHAT, chat(),
                                        headers=[(HEADER, f"127.0.0.1:{b.port}")])
            assert reply.status == 200, (allow, reply.body)
            assert len(generations(b)) == 1 and generations(a) == []
            other_port = await proxy.request("POST", CHAT, chat(),
                                             headers=[(HEADER, f"127.0.0.1:{c.port}")])
            assert other_port.status == (200 if ":" not in allow else 403)


async def test_a_list_of_targets_takes_the_first_as_llm_ds_sidecar_does():
    """The scheduler lists its best first: the sidecar takes it (unless sampling is
    turned on) and holds only it to the allow list; ``http://host:port`` is read too."""
    async with cluster(prefill_header_allow=("127.0.0.1",)) as (proxy, (a, b, c), decode):
        for named in (f"127.0.0.1:{b.port}, 127.0.0.1:{c.port}",
                      f"127.0.0.1:{b.port}, 169.254.169.254:80",  # the second not allowed
                      f"http://127.0.0.1:{b.port}/"):
            for _ in range(4):
                reply = await proxy.request("POST", CHAT, chat(), headers=[(HEADER, named)])
                assert reply.status == 200, (named, reply.body)
        assert generations(a) == [] and generations(c) == []
        assert len(generations(b)) == 12


async def test_mooncake_with_a_named_target_uses_its_bootstrap_server():
    registry = KvRegistry()
    a, b = [await DemoBackend("prefill", registry=registry).start() for _ in range(2)]
    decode = await DemoBackend("decode", registry=registry).start(bootstrap_port=None)
    try:
        config = config_for(a.url, decode.url, kv_protocol="mooncake",
                            mooncake_bootstrap_port=b.bootstrap_port,
                            prefill_header_allow=(f"127.0.0.1:{b.port}",))
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat(),
                                        headers=[(HEADER, f"127.0.0.1:{b.port}")])
            assert reply.status == 200, reply.body
            [dc] = generations(decode)
            kv = dc.body["kv_transfer_params"]
            assert kv["remote_engine_id"] == b.engine_ids["0"]
            assert kv["remote_bootstrap_addr"] == f"http://127.0.0.1:{b.bootstrap_port}"
            assert (a.bootstrap_queries, b.bootstrap_queries) == (0, 1)
            assert no_header_reached(a, b, decode)
    finally:
        for backend in (a, b, decode):
            await backend.close()


async def test_target_outside_the_allowlist_is_refused_without_any_backend_call():
    async with cluster(prefill_header_allow=("10.0.0.0/8", "127.0.0.1:1")) as (
            proxy, (a, b, c), decode):
        for named in (f"127.0.0.1:{b.port}", "169.254.169.254:80",
                      f"127.0.0.1:{b.port}, 10.1.2.3:8000", "evil.example:80"):
            reply = await proxy.request("POST", CHAT, chat(), headers=[(HEADER, named)])
            assert reply.status == 403, named
            assert reply.header("content-type") == b"application/json"
            assert reply.json()["error"]["type"] == "prefill_target_refused"
        assert all(backend.received == [] for backend in (a, b, c, decode))
        assert all(backend.bootstrap_queries == 0 for backend in (a, b, c))


async def test_malformed_target_is_a_client_error():
    async with cluster(prefill_header_allow=("127.0.0.1",)) as (proxy, (a, b, c), decode):
        for named in ("127.0.0.1", "127.0.0.1:notaport", "127.0.0.1:70000"):
            reply = await proxy.request("POST", CHAT, chat(), headers=[(HEADER, named)])
            assert reply.status == 400, named
            reply.json()  # a JSON answer
        assert decode.received == [] and a.received == []


async def test_header_is_ignored_without_an_allowlist(caplog):
    caplog.set_level(logging.WARNING, logger="lowproxy")
    async with cluster() as (proxy, (a, b, c), decode):
        for named in (f"127.0.0.1:{b.port}", "169.254.169.254:80", "garbage"):
            reply = await proxy.request("POST", CHAT, chat(), headers=[(HEADER, named)])
            assert reply.status == 200, reply.body
        assert len(generations(a)) == 3 and generations(b) == []
        assert no_header_reached(a, b, c, decode)
    # Said once, naming the setting: a scheduler's choice silently dropped would
    # leave an operator guessing why PD never follows it.
    told = [r.getMessage() for r in caplog.records if "x-prefiller-host-port" in r.getMessage()]
    assert len(told) == 1 and "PD_PROXY_PREFILL_HEADER_ALLOW" in told[0]


async def test_named_target_without_configured_prefill():
    registry = KvRegistry()
    b = await DemoBackend("prefill", registry=registry).start(bootstrap_port=None)
    decode = await DemoBackend("decode", registry=registry).start(bootstrap_port=None)
    try:
        config = config_for((), decode.url, prefill_header_allow=("127.0.0.1",))
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat(),
                                        headers=[(HEADER, f"127.0.0.1:{b.port}")])
            assert reply.status == 200 and len(generations(b)) == 1
            reply = await proxy.request("POST", CHAT, chat())  # no header: decode only
            assert reply.status == 200 and len(generations(b)) == 1
            assert len(generations(decode)) == 2
    finally:
        await b.close()
        await decode.close()


async def test_named_configured_prefill_keeps_its_bootstrap_port_override():
    """The scheduler names a configured endpoint: its #bootstrap_port applies."""
    registry = KvRegistry()
    a, b = [await DemoBackend("prefill", registry=registry).start() for _ in range(2)]
    decode = await DemoBackend("decode", registry=registry).start(bootstrap_port=None)
    try:
        urls = [f"{p.url}#bootstrap_port={p.bootstrap_port}" for p in (a, b)]
        config = config_for(urls, decode.url, kv_protocol="mooncake",
                            mooncake_bootstrap_port=1,  # nothing listens there
                            prefill_header_allow=("127.0.0.1",))
        async with running_proxy(config) as proxy:
            for _ in range(3):
                reply = await proxy.request("POST", CHAT, chat(),
                                            headers=[(HEADER, f"127.0.0.1:{b.port}")])
                assert reply.status == 200, reply.body
            assert generations(a) == [] and len(generations(b)) == 3
            assert all("transfer_id" in d.body["kv_transfer_params"] for d in generations(decode))
            assert b.bootstrap_queries == 1
    finally:
        for backend in (a, b, decode):
            await backend.close()
