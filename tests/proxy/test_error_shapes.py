"""Every answer the proxy writes itself, in the shape of the surface the client called.

OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on the OpenAI
surfaces, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on
/v1/messages, and the GCO proxy's own bodies, byte for byte, wherever it gave
them. Also: x-api-key, the Anthropic SDK's header, on the Messages surface.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from helpers import (
    CHAT,
    RawServer,
    chat,
    config_for,
    free_port,
    read_request,
    running_proxy,
    wait_until,
)
from lowproxy.demo import DemoBackend, start_pair

MESSAGES = "/v1/messages"
KEY = "ck-anthropic-client"


def message(**extra: Any) -> dict[str, Any]:
    body = {"model": "demo-model", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}]}
    body.update(extra)
    return body


def openai_error(reply: Any, status: int) -> dict[str, Any]:
    assert reply.status == status, reply.body
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param",
                                                             "code"}, body
    assert body["error"]["message"]
    return body["error"]


def anthropic_error(reply: Any, status: int, kind: str) -> str:
    assert reply.status == status, reply.body
    body = reply.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["message"]
    return str(body["error"]["message"])


@contextlib.asynccontextmanager
async def demo_proxy(**overrides: Any) -> AsyncIterator[tuple[Any, DemoBackend, DemoBackend]]:
    prefill, decode = await start_pair()
    try:
        async with running_proxy(config_for(prefill.url, decode.url, **overrides)) as running:
            yield running, prefill, decode
    finally:
        await prefill.close()
        await decode.close()


# -- x-api-key on the Messages surface


async def test_x_api_key_is_accepted_on_messages_and_never_forwarded():
    async with demo_proxy(client_api_keys=(KEY,), forward_authorization=True) as (
            running, prefill, decode):
        reply = await running.request("POST", MESSAGES, message(), headers=[("x-api-key", KEY)])
        assert reply.status == 200, reply.body
        assert reply.json()["type"] == "message"
        for backend in (prefill, decode):
            [leg] = backend.requests_to(MESSAGES)
            assert leg.header("x-api-key") is None  # a secret no setting sends on
        # Bearer still works there; x-api-key is the Messages surface's only.
        bearer = [("authorization", f"Bearer {KEY}")]
        assert (await running.request("POST", MESSAGES, message(), headers=bearer)).status == 200
        refused = await running.request("POST", CHAT, chat(), headers=[("x-api-key", KEY)])
        assert "authorization: Bearer" in openai_error(refused, 401)["message"]
        assert refused.header("www-authenticate") == b"Bearer"
        # The SDKs parse an error body only when it is said to be JSON.
        assert refused.header("content-type") == b"application/json"


async def test_a_wrong_x_api_key_is_refused_in_anthropic_shape():
    async with demo_proxy(client_api_keys=(KEY,)) as (running, prefill, decode):
        for headers in ([("x-api-key", "wrong")], [], [("authorization", "Bearer wrong")]):
            reply = await running.request("POST", MESSAGES, message(), headers=headers)
            shown = anthropic_error(reply, 401, "authentication_error")
            assert reply.header("content-type") == b"application/json"
            assert "x-api-key" in shown and "wrong" not in reply.body.decode()
        assert decode.requests_to(MESSAGES) == [] and prefill.requests_to(MESSAGES) == []


# -- each kind of answer, per surface


async def test_invalid_bodies_keep_the_gco_bodies_on_every_surface():
    async with demo_proxy() as (running, _, decode):
        for path in (CHAT, MESSAGES, "/v1/embeddings"):
            bad = await running.request("POST", path, raw_body=b"{not json")
            assert (bad.status, bad.body) == (400, b'{"error":"invalid JSON body"}'), path
            listed = await running.request("POST", path, raw_body=b"[1]")
            assert (listed.status, listed.body) == (400, b'{"error":"JSON body must be an object"}')
        assert decode.received == []


async def test_an_unknown_model_in_each_shape():
    prefill = await DemoBackend("prefill", served_model_names=["alpha"]).start()
    decode = await DemoBackend("decode", served_model_names=["alpha"]).start(bootstrap_port=None)
    try:
        async with running_proxy(config_for(prefill.url, decode.url,
                                            health_interval=60)) as running:
            await wait_until(running.proxy.decode.lists_known, 10, "model lists")
            error = openai_error(await running.request("POST", CHAT, chat(model="nope")), 404)
            assert (error["param"], error["code"]) == ("model", "model_not_found")
            shown = anthropic_error(await running.request("POST", MESSAGES, message(model="nope")),
                                    404, "not_found_error")
            assert "nope" in shown
    finally:
        await prefill.close()
        await decode.close()


async def test_a_refused_prefill_target_in_each_shape():
    async with demo_proxy(prefill_header_allow=("10.0.0.0/8",)) as (running, prefill, decode):
        header = [("x-prefiller-host-port", "127.0.0.1:1")]
        error = openai_error(await running.request("POST", CHAT, chat(), headers=header), 403)
        assert (error["type"], error["param"]) == ("prefill_target_refused",
                                                   "x-prefiller-host-port")
        anthropic_error(await running.request("POST", MESSAGES, message(), headers=header),
                        403, "permission_error")
        assert decode.received == [] and prefill.received == []


async def test_draining_answers_503_in_each_shape():
    async with demo_proxy() as (running, _, decode):
        running.proxy.draining = True
        assert openai_error(await running.request("POST", CHAT, chat()), 503)["code"] == 503
        anthropic_error(await running.request("POST", MESSAGES, message()), 503,
                        "overloaded_error")
        assert decode.received == []


async def test_a_body_too_large_in_each_shape():
    async with demo_proxy(max_body_bytes=64) as (running, _, decode):
        big = "x" * 200
        error = openai_error(await running.request("POST", CHAT, chat(user=big)), 413)
        assert error["type"] == "request_too_large"
        anthropic_error(await running.request("POST", MESSAGES, message(system=big)), 413,
                        "request_too_large")
        assert decode.received == []


class HangsUp(RawServer):
    """A decode that reads the request and closes without an answer."""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    number: int) -> None:
        await read_request(reader)


async def test_backend_failures_in_each_shape():
    broken = await HangsUp().start()
    try:
        async with running_proxy(config_for((), broken.url)) as running:
            error = openai_error(await running.request("POST", CHAT, chat()), 502)
            assert error["type"] == "upstream_error"
            anthropic_error(await running.request("POST", MESSAGES, message()), 502, "api_error")
        # A prefill that fails, with PD_PROXY_ON_PREFILL_FAILURE=error: 502 prefill_failed.
        prefill, decode = await start_pair()
        closed = f"http://127.0.0.1:{free_port()}"
        try:
            async with running_proxy(config_for(closed, decode.url,
                                                on_prefill_failure="error")) as running:
                error = openai_error(await running.request("POST", CHAT, chat()), 502)
                assert error["type"] == "prefill_failed"
                anthropic_error(await running.request("POST", MESSAGES, message()), 502,
                                "api_error")
        finally:
            await prefill.close()
            await decode.close()
    finally:
        await broken.close()


async def test_no_decode_backend_keeps_the_gco_body():
    closed = f"http://127.0.0.1:{free_port()}"
    async with running_proxy(config_for((), closed)) as running:
        for path, body in ((CHAT, chat()), (MESSAGES, message())):
            reply = await running.request("POST", path, body)
            assert (reply.status, reply.body) == (
                503, b'{"error":{"message":"no available decode backend",'
                     b'"type":"no_decode_backend"}}'), path
