"""Issue 13's smaller things: the decode first-byte bound, x-request-id on answers,
and the backend named in every failure line and in the access line."""

from __future__ import annotations

import asyncio
import logging

from helpers import CHAT, ScriptedBackend, chat, config_for, pd_setup, running_proxy


async def _hang(request, responder) -> None:
    await asyncio.sleep(30)  # never sends a head


async def test_decode_first_byte_timeout_is_a_504_naming_the_backend(caplog):
    caplog.set_level(logging.INFO, logger="lowproxy")
    decode = await ScriptedBackend(_hang).start()
    try:
        config = config_for(decode=decode.url(), decode_first_byte_timeout=0.3)
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat(), timeout=10)
            assert reply.status == 504
            # Said to be a timeout, and counted as one, not as a failure.
            assert reply.json()["error"]["type"] == "upstream_timeout"
            assert reply.json()["error"]["message"] == "decode backend timed out"
            metrics = (await proxy.request("GET", "/metrics")).body.decode()
            assert 'lowproxy_decode_legs_total{outcome="timeout"} 1' in metrics, metrics
            await asyncio.sleep(0)
    finally:
        await decode.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no response head within 0.3s" in r.getMessage()
               and r.fields.get("backend") == decode.url() for r in warnings), caplog.text
    assert decode.hung_up == 1  # the leg was closed, so vLLM aborts it


async def test_without_the_bound_a_slow_head_is_waited_for():
    async def slow(request, responder):
        await asyncio.sleep(0.5)
        await responder.send_json(200, {"ok": True})

    decode = await ScriptedBackend(slow).start()
    try:
        async with running_proxy(config_for(decode=decode.url())) as proxy:
            assert (await proxy.request("POST", CHAT, chat())).status == 200
    finally:
        await decode.close()


async def test_answers_carry_the_clients_request_id_or_the_one_made_here():
    async with pd_setup() as (proxy, prefill, decode):
        mine = await proxy.request("POST", CHAT, chat(), headers=[("x-request-id", "abc-1")])
        assert mine.status == 200 and mine.header_values("x-request-id") == [b"abc-1"]
        made = await proxy.request("POST", CHAT, chat())
        [value] = made.header_values("x-request-id")
        assert len(value) == 32
        [dc] = decode.requests_to(CHAT)[-1:]
        assert dc.header("x-request-id") == value  # the same id went to the legs
        refused = await proxy.request("POST", CHAT, raw_body=b"{not json",
                                      headers=[("x-request-id", "bad-1")])
        assert refused.status == 400 and refused.header("x-request-id") == b"bad-1"
        passthrough = await proxy.request("GET", "/v1/models",
                                          headers=[("x-request-id", "m-1")])
        assert passthrough.header_values("x-request-id") == [b"m-1"]
