"""Failing backends: what the client sees when decode or prefill misbehaves.

A decode that dies after its response started must reach the client as a
truncated response (no final chunk, or fewer bytes than Content-Length), which
an HTTP client reports as an error, never as a clean end. Slow backends are
waited for (a generation has no bound by default) unless a timeout is set; a
prefill that never answers is bounded by the prefill timeout.
"""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest

from helpers import (
    CHAT,
    ScriptedBackend,
    chat,
    client_for,
    config_for,
    pd_setup,
    running_proxy,
    wait_until,
)
from lowproxy.downstream import AbortResponse


def warnings_for(caplog, request_id: str) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno >= logging.WARNING
            and getattr(record, "fields", {}).get("request_id") == request_id]


# -- decode dies after its response started


async def test_decode_dying_mid_stream_is_a_truncated_response(caplog):
    caplog.set_level(logging.WARNING)
    async with pd_setup() as (proxy, prefill, decode):
        decode.faults.die_after_chunks = 2
        reply = await proxy.request("POST", CHAT, chat(stream=True, max_tokens=10),
                                    headers=[("x-request-id", "cut-1")])
        assert reply.status == 200
        assert not reply.complete  # the connection ended inside the chunked body
        assert reply.body.count(b"data: ") == 2 and b"[DONE]" not in reply.body
        logged = warnings_for(caplog, "cut-1")
        assert any("broke off" in message for message in logged), logged
        # The next request is served normally.
        decode.faults.die_after_chunks = None
        reply = await proxy.request("POST", CHAT, chat(stream=True))
        assert reply.complete and reply.body.endswith(b"data: [DONE]\n\n")


async def test_decode_dying_mid_stream_makes_the_openai_client_raise():
    async with pd_setup() as (proxy, prefill, decode):
        decode.faults.die_after_chunks = 3
        received = []
        async with client_for(proxy.port) as client:
            stream = await client.chat.completions.create(
                model="demo-model", messages=[{"role": "user", "content": "hi"}],
                max_tokens=10, stream=True)
            # The SDK sees the cut (an incomplete chunked read), not a clean end.
            with pytest.raises(openai.APIConnectionError):
                async for chunk in stream:
                    received.append(chunk.choices[0].delta.content)
        assert received == ["tok0 ", "tok1 ", "tok2 "]


async def test_decode_dying_inside_a_content_length_body_is_cut_short(caplog):
    caplog.set_level(logging.WARNING)

    async def half_a_body(request, responder):
        await responder.start(200, [(b"content-type", b"application/json")],
                              content_length=1000)
        await responder.write(b'{"partial": "' + b"x" * 100)
        raise AbortResponse()  # the backend's connection drops mid-body

    decode = await ScriptedBackend(half_a_body).start()
    try:
        async with running_proxy(config_for((), decode.url())) as proxy:
            reply = await proxy.request("POST", CHAT, chat(), headers=[("x-request-id", "cl-1")])
            assert reply.status == 200
            assert reply.header("content-length") == b"1000"
            assert not reply.complete and len(reply.body) < 1000
            assert warnings_for(caplog, "cl-1")
            # The same proxy answers the next request in full.
            decode.answer = lambda request, responder: responder.send_json(200, {"ok": True})
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.complete and reply.json() == {"ok": True}
    finally:
        await decode.close()


async def test_decode_closing_without_any_answer_is_a_502():
    async with pd_setup() as (proxy, prefill, decode):
        decode.faults.close_without_response = True
        reply = await proxy.request("POST", CHAT, chat(stream=True))
        assert reply.status == 502 and reply.complete
        assert reply.json()["error"]["type"] == "upstream_error"


# -- slow decode


async def test_slow_decode_is_waited_for_by_default():
    async with pd_setup() as (proxy, prefill, decode):
        decode.faults.delay = 0.6  # before the head
        decode.chunk_delay = 0.15  # between events
        reply = await proxy.request("POST", CHAT, chat(stream=True, max_tokens=4))
        assert reply.status == 200 and reply.complete
        assert reply.body.count(b"data: ") == 5  # 4 tokens and [DONE]


async def test_decode_timeout_before_the_answer_is_a_504():
    async with pd_setup(decode_timeout=0.3) as (proxy, prefill, decode):
        decode.faults.delay = 5
        reply = await proxy.request("POST", CHAT, chat(stream=True))
        assert reply.status == 504 and reply.complete
        assert reply.json()["error"]["type"] == "upstream_timeout"
        await wait_until(lambda: decode.abandoned == 1, what="decode leg closed")


async def test_decode_timeout_during_the_stream_cuts_it():
    async with pd_setup(decode_timeout=0.5) as (proxy, prefill, decode):
        decode.stream_chunks, decode.chunk_delay = 1000, 0.05
        reply = await proxy.request("POST", CHAT, chat(stream=True))
        assert reply.status == 200 and not reply.complete
        assert b"data: " in reply.body and b"[DONE]" not in reply.body
        await wait_until(lambda: decode.aborted_streams == 1, what="decode stream closed")


# -- prefill that never answers


async def test_prefill_that_never_answers_is_bounded_then_decode_recomputes():
    async with pd_setup(prefill_timeout=0.3) as (proxy, prefill, decode):
        prefill.faults.hang = True
        reply = await proxy.request("POST", CHAT, chat(), headers=[("x-request-id", "pf-1")])
        assert reply.status == 200 and reply.complete
        [leg] = decode.requests_to(CHAT)
        assert "kv_transfer_params" not in leg.body  # recomputed: nothing to pull
        await wait_until(lambda: prefill.abandoned == 1, what="prefill leg closed")


async def test_prefill_that_never_answers_is_a_502_when_configured():
    async with pd_setup(prefill_timeout=0.3, on_prefill_failure="error") as (
            proxy, prefill, decode):
        prefill.faults.hang = True
        reply = await proxy.request("POST", CHAT, chat())
        assert reply.status == 502
        assert reply.json()["error"]["type"] == "prefill_failed"
        assert decode.requests_to(CHAT) == []


async def test_prefill_that_accepts_and_never_reads_is_bounded():
    """A socket that accepts but never reads nor answers (a wedged process)."""
    accepted = []

    async def wedged(reader, writer):
        accepted.append((reader, writer))
        await asyncio.Event().wait()

    server = await asyncio.start_server(wedged, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    decode = await ScriptedBackend(
        lambda request, responder: responder.send_json(200, {"decoded": True})).start()
    try:
        config = config_for(f"http://127.0.0.1:{port}", decode.url(), prefill_timeout=0.3)
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 200 and reply.json() == {"decoded": True}
            [(reader, _)] = accepted
            # The proxy gave up on the wedged connection and closed it.
            with pytest.raises((ConnectionError, EOFError, asyncio.IncompleteReadError)):
                while True:
                    if not await asyncio.wait_for(reader.read(65536), 5):
                        raise EOFError()
    finally:
        for _, writer in accepted:
            writer.close()
        server.close()
        await decode.close()


async def test_prefill_500_falls_back_to_decode():
    async with pd_setup() as (proxy, prefill, decode):
        prefill.faults.status = 500
        reply = await proxy.request("POST", CHAT, chat(stream=True))
        assert reply.status == 200 and reply.complete
        assert "kv_transfer_params" not in decode.requests_to(CHAT)[0].body


# -- the client vanishing


async def test_client_vanishing_mid_body_never_reaches_a_backend():
    async with pd_setup() as (proxy, prefill, decode):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"content-length: 500\r\n\r\n{\"model\":")
        await writer.drain()
        await wait_until(lambda: proxy.server.connections, what="connection accepted")
        writer.transport.abort()
        await wait_until(lambda: not proxy.server.connections, what="connection dropped")
        assert decode.received == [] and prefill.received == []
