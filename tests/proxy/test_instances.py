"""/instances: backends added, removed and listed at run time, over real sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from helpers import (
    CHAT,
    ScriptedBackend,
    chat,
    config_for,
    demo_backends,
    free_port,
    running_proxy,
    wait_until,
)
from lowproxy.demo import DemoBackend, start_pair
from lowproxy.proxy import admin

ADMIN = [("x-admin-api-key", "adm")]


def generations(backend: DemoBackend) -> int:
    return sum(1 for r in backend.received if r.path == CHAT)


async def listing(proxy: Any) -> dict[str, Any]:
    reply = await proxy.request("GET", "/instances", headers=ADMIN)
    assert reply.status == 200
    return reply.json()


# -- the GCO answer stays, and the key rules


@pytest.mark.parametrize("body", [None, {}, {"instance": "anything"}])
async def test_add_without_a_type_is_the_gco_answer(body):
    async with demo_backends(1) as [decode]:
        async with running_proxy(config_for((), decode.url, admin_api_key="adm")) as proxy:
            reply = await proxy.request("POST", "/v1/instances/add", body, headers=ADMIN)
            assert reply.status == 200 and reply.json() == {"status": "ok"}
            assert decode.received == []
            assert len(proxy.proxy.decode.endpoints) == 1


@pytest.mark.parametrize("method, path", [("POST", "/instances/add"),
                                          ("POST", "/instances/remove"), ("GET", "/instances"),
                                          ("GET", "/prefix/instances")])
@pytest.mark.parametrize("key, headers", [("adm", []), ("adm", [("x-admin-api-key", "no")]),
                                          ("adm", [("authorization", "Bearer no")]),
                                          ("adm", [("authorization", "no")]),
                                          ("adm", [("authorization", "Basic adm")]),
                                          ("", [("x-admin-api-key", "")])])
async def test_every_admin_path_needs_the_admin_key(method, path, key, headers):
    async with demo_backends(1) as [decode]:
        async with running_proxy(config_for((), decode.url, admin_api_key=key)) as proxy:
            reply = await proxy.request(method, path, {"type": "decode",
                                                       "instance": decode.url}
                                        if method == "POST" else None, headers=headers)
            assert reply.status == 403 and reply.json() == {"error": "forbidden"}
            assert decode.received == []


@pytest.mark.parametrize("method, path, allowed", [("GET", "/instances/add", b"POST"),
                                                   ("OPTIONS", "/instances/remove", b"POST"),
                                                   ("POST", "/instances", b"GET")])
async def test_a_wrong_method_is_405_and_never_forwarded(method, path, allowed):
    async with demo_backends(1) as [decode]:
        async with running_proxy(config_for((), decode.url, admin_api_key="adm")) as proxy:
            reply = await proxy.request(method, path, headers=ADMIN)
            assert reply.status == 405 and reply.header("allow") == allowed
            assert decode.received == []


@pytest.mark.parametrize("authorization", ["adm", "Bearer adm", "bearer adm"])
async def test_the_admin_key_is_taken_bare_in_authorization_as_the_gco_proxy_took_it(
        authorization):
    async with demo_backends(1) as [decode]:
        async with running_proxy(config_for((), decode.url, admin_api_key="adm")) as proxy:
            reply = await proxy.request("POST", "/instances/add", None,
                                        headers=[("authorization", authorization)])
            assert reply.status == 200 and reply.json() == {"status": "ok"}


# -- add


async def test_added_decode_takes_requests_and_is_listed_as_admin():
    async with demo_backends(2) as [static, added]:
        async with running_proxy(config_for((), static.url, admin_api_key="adm")) as proxy:
            reply = await proxy.request("POST", "/instances/add",
                                        {"type": "decode", "instance": f"127.0.0.1:{added.port}"},
                                        headers=[("authorization", "Bearer adm")])
            assert reply.status == 200
            assert reply.json() == {"status": "ok", "type": "decode", "instance": added.url}
            assert [r.path for r in added.received] == ["/v1/models"]  # the check
            for _ in range(4):
                assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert generations(static) == generations(added) == 2
            listed = await listing(proxy)
            assert listed["decode"] == [
                {"instance": static.url, "source": "static", "state": "usable", "in_flight": 0},
                {"instance": added.url, "source": "admin", "state": "usable", "in_flight": 0}]
            assert listed["prefill"] == [] and listed["removed"] == []


async def test_added_prefill_with_bootstrap_port_is_used_for_prefill_legs():
    prefill, decode = await start_pair()  # one KV registry: decode finds prefill's KV
    try:
        async with running_proxy(config_for((), decode.url, admin_api_key="adm",
                                            kv_protocol="mooncake")) as proxy:
            instance = f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}"
            reply = await proxy.request("POST", "/instances/add",
                                        {"type": "prefill", "instance": instance},
                                        headers=ADMIN)
            assert reply.status == 200 and reply.json()["instance"] == instance
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert generations(prefill) == 1 and generations(decode) == 1
            assert prefill.bootstrap_queries == 1  # found through the port it was added with
            assert (await listing(proxy))["prefill"][0]["source"] == "admin"
    finally:
        await prefill.close()
        await decode.close()


async def test_adding_one_already_present_is_ok_and_adds_nothing():
    async with demo_backends(1) as [decode]:
        async with running_proxy(config_for((), decode.url, admin_api_key="adm")) as proxy:
            for instance in (decode.url, f"127.0.0.1:{decode.port}", decode.url + "/"):
                reply = await proxy.request("POST", "/instances/add",
                                            {"type": "decode", "instance": instance},
                                            headers=ADMIN)
                assert reply.status == 200 and reply.json()["instance"] == decode.url
            assert len(proxy.proxy.decode.endpoints) == 1
            assert (await listing(proxy))["decode"][0]["source"] == "static"


async def test_the_check_carries_the_backend_key():
    async with demo_backends(1, api_key="backend-key") as [added]:
        config = config_for((), (), admin_api_key="adm", backend_api_key="backend-key")
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", "/instances/add",
                                        {"type": "decode", "instance": added.url},
                                        headers=ADMIN)
            assert reply.status == 200
            assert added.received[0].header("authorization") == b"Bearer backend-key"
            # The admin's own key never reaches a backend.
            assert added.received[0].header("x-admin-api-key") is None


async def test_an_instance_refusing_the_check_is_502_with_why():
    async with demo_backends(1, api_key="backend-key") as [added]:
        async with running_proxy(config_for((), (), admin_api_key="adm")) as proxy:
            reply = await proxy.request("POST", "/instances/add",
                                        {"type": "decode", "instance": added.url},
                                        headers=ADMIN)
            assert reply.status == 502
            assert "401" in reply.json()["error"]["message"]
            assert proxy.proxy.decode.endpoints == []


async def test_an_instance_not_listening_is_502_with_why():
    port = free_port()
    async with running_proxy(config_for((), (), admin_api_key="adm")) as proxy:
        reply = await proxy.request("POST", "/instances/add",
                                    {"type": "prefill", "instance": f"127.0.0.1:{port}"},
                                    headers=ADMIN)
        assert reply.status == 502
        error = reply.json()["error"]
        assert error["type"] == "instance_unreachable" and str(port) in error["message"]
        assert proxy.proxy.prefill.endpoints == []


async def test_an_instance_that_never_answers_is_502_after_the_bound(monkeypatch):
    monkeypatch.setattr(admin, "CHECK_SECONDS", 0.2)
    never = asyncio.Event()

    async def hang(request: Any, responder: Any) -> None:
        await never.wait()

    silent = await ScriptedBackend(hang).start()
    try:
        async with running_proxy(config_for((), (), admin_api_key="adm")) as proxy:
            reply = await proxy.request("POST", "/instances/add",
                                        {"type": "decode", "instance": silent.url()},
                                        headers=ADMIN)
            assert reply.status == 502 and "within" in reply.json()["error"]["message"]
            assert proxy.proxy.decode.endpoints == []
    finally:
        await silent.close()


@pytest.mark.parametrize("raw", [b"not json", b"[1]"])
async def test_a_body_that_is_not_an_object_is_400(raw):
    async with running_proxy(config_for((), (), admin_api_key="adm")) as proxy:
        reply = await proxy.request("POST", "/instances/add", raw_body=raw, headers=ADMIN)
        assert reply.status == 400


@pytest.mark.parametrize("body", [
    {"type": "encode", "instance": "127.0.0.1:8000"},
    {"type": "decode"},
    {"type": "decode", "instance": 8000},
    {"type": "decode", "instance": ""},
    {"type": "decode", "instance": "ftp://h:1"},
    {"type": "decode", "instance": "127.0.0.1:port"},
    {"type": "decode", "instance": "http://h:8000/v1"},
    {"type": "decode", "instance": "dns+http://svc:8000"},
    {"type": "decode", "instance": "http://h:8000#other=1"},
])
@pytest.mark.parametrize("path", ["/instances/add", "/instances/remove"])
async def test_a_bad_body_is_400_and_changes_nothing(body, path):
    async with running_proxy(config_for((), (), admin_api_key="adm")) as proxy:
        reply = await proxy.request("POST", path, body, headers=ADMIN)
        assert reply.status == 400
        assert reply.json()["error"]["type"] == "invalid_request"
        assert proxy.proxy.decode.endpoints == []


# -- remove


async def test_remove_lets_requests_in_flight_finish_and_sends_no_new_ones():
    async with demo_backends(2, stream_chunks=30, chunk_delay=0.02) as [first, second]:
        config = config_for((), [first.url, second.url], admin_api_key="adm")
        async with running_proxy(config) as proxy:
            streaming = asyncio.create_task(proxy.request("POST", CHAT, chat(stream=True)))
            await wait_until(lambda: first.open_streams + second.open_streams == 1,
                             what="a stream in flight")
            busy, idle = (first, second) if first.open_streams else (second, first)
            reply = await proxy.request("POST", "/instances/remove",
                                        {"type": "decode", "instance": busy.url},
                                        headers=ADMIN)
            assert reply.status == 200 and reply.json()["instance"] == busy.url
            listed = await listing(proxy)
            assert [e["instance"] for e in listed["decode"]] == [idle.url]
            assert listed["removed"] == [{"type": "decode", "instance": busy.url,
                                          "in_flight": 1}]
            for _ in range(3):
                assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert generations(busy) == 1 and generations(idle) == 3
            streamed = await streaming
            assert streamed.status == 200 and streamed.complete
            assert b"data: [DONE]" in streamed.body
            group = proxy.proxy.decode
            [retired] = group.retired
            group.sweep_retired(proxy.proxy.upstream)  # what each maintenance round does
            assert group.retired == [] and retired.open == 0 and retired.in_flight == 0
            reply = await proxy.request("POST", "/instances/remove",
                                        {"type": "decode", "instance": busy.url},
                                        headers=ADMIN)
            assert reply.status == 404 and reply.json()["error"]["type"] == "not_found"


async def test_an_added_instance_can_be_removed_and_added_again():
    async with demo_backends(1) as [decode]:
        async with running_proxy(config_for((), (), admin_api_key="adm")) as proxy:
            body = {"type": "decode", "instance": decode.url}
            assert (await proxy.request("POST", "/instances/add", body,
                                        headers=ADMIN)).status == 200
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert (await proxy.request("POST", "/instances/remove", body,
                                        headers=ADMIN)).status == 200
            assert (await proxy.request("POST", CHAT, chat())).status == 503  # none left
            assert (await proxy.request("POST", "/instances/remove", body,
                                        headers=ADMIN)).status == 404
            assert (await proxy.request("POST", "/instances/add", body,
                                        headers=ADMIN)).status == 200
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert generations(decode) == 2


# -- alongside DNS discovery and cooldowns


class Resolver:
    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)

    async def __call__(self, host: str, port: int) -> list[str]:
        return list(self.addresses)


async def test_admin_added_endpoints_survive_dns_refreshes():
    async with demo_backends(2) as [discovered, added]:
        resolver = Resolver("127.0.0.1")
        config = config_for((), f"dns+http://decode.svc:{discovered.port}", admin_api_key="adm")
        async with running_proxy(config, resolver=resolver) as proxy:
            reply = await proxy.request("POST", "/instances/add",
                                        {"type": "decode", "instance": added.url},
                                        headers=ADMIN)
            assert reply.status == 200
            resolver.addresses = ["127.0.0.1"]
            await proxy.proxy.refresh_discovery()
            listed = await listing(proxy)
            assert [(e["instance"], e["source"]) for e in listed["decode"]] == [
                (discovered.url, "dns"), (added.url, "admin")]
            resolver.addresses = []  # the Service lost its pods: the added one stays
            await proxy.proxy.refresh_discovery()
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert generations(added) == 1
            resolver.addresses = ["127.0.0.1"]
            await proxy.proxy.refresh_discovery()
            reply = await proxy.request("POST", "/instances/remove",
                                        {"type": "decode", "instance": discovered.url},
                                        headers=ADMIN)
            assert reply.status == 409  # the next refresh would bring it back
            assert len(proxy.proxy.decode.endpoints) == 2


async def test_listing_shows_an_endpoint_cooling_down():
    async with demo_backends(1) as [live]:
        dead = f"http://127.0.0.1:{free_port()}"
        async with running_proxy(config_for((), [dead, live.url], admin_api_key="adm")) as proxy:
            for _ in range(2):  # one of them lands on the dead endpoint first
                assert (await proxy.request("POST", CHAT, chat())).status == 200
            states = {e["instance"]: e["state"] for e in (await listing(proxy))["decode"]}
            assert states == {dead: "cooling down", live.url: "usable"}


async def test_a_leg_sent_after_its_prefill_was_removed_leaves_no_pooled_connection():
    """A Mooncake request chose its prefill, then waited on the bootstrap query while
    the prefill was removed: its leg still went there, and the connection was pooled
    on an endpoint nothing sweeps (open until the backend closed it, in no gauge).
    A removed endpoint's connection is closed when its request ends (chaos soak)."""
    prefill, decode = await start_pair()
    answer_query = prefill.bootstrap_server.handler
    asked = asyncio.Event()

    async def slow_query(request: Any, responder: Any) -> None:
        asked.set()
        await asyncio.sleep(1.0)  # the window between the choice and the leg
        await answer_query(request, responder)

    prefill.bootstrap_server.handler = slow_query
    try:
        config = config_for(f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}",
                            decode.url, kv_protocol="mooncake", admin_api_key="adm")
        async with running_proxy(config) as proxy:
            [chosen] = proxy.proxy.prefill.endpoints
            pending = asyncio.create_task(proxy.request("POST", CHAT, chat()))
            await asyncio.wait_for(asked.wait(), 5)  # the request waits on the query now
            reply = await proxy.request("POST", "/instances/remove",
                                        {"type": "prefill", "instance": prefill.url},
                                        headers=ADMIN)
            assert reply.status == 200
            assert (await pending).status == 200
            await wait_until(lambda: chosen.in_flight == 0, 5, "the leg ended")
            assert chosen.open == 0 and chosen.idle == []  # closed, not pooled
    finally:
        await prefill.close()
        await decode.close()
