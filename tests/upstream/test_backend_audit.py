"""What an audit of hostile backends found (session 36), each pinned over real sockets.

- A backend sending 1xx heads for ever held the request and grew what was
  written to a client that does not read: more than five (Go's transport's
  bound) end the exchange, 502.
- A backend answering before it read the whole request (an early 413) left
  the rest queued in the proxy's write buffer; the connection was pooled, and
  the next request waited behind it for ever. It is pooled only once all sent.
- A 204 carrying a body was relayed with its Content-Length.
- A chunk-size line over the bound was accepted when it came in one read.
- A decode answer read whole (its usage rewritten) that broke off was a 502
  to the client but 499 in the access line and metrics.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from test_upstream_hostile import CLOSE, EARLY_HINTS, RESET, answer, call, hostile, pool_for

from helpers import CHAT, chat, config_for, raw_exchange, running_proxy
from lowproxy.upstream.chunked import MAX_LINE, ChunkedDecoder, ChunkedError
from lowproxy.upstream.cycle import MAX_INFORMATIONAL
from lowproxy.upstream.pool import UpstreamProtocolError

# -- 1xx heads without end


async def test_informational_heads_past_the_bound_end_the_exchange():
    flood = EARLY_HINTS * (MAX_INFORMATIONAL + 1) + answer(b"final")
    async with hostile([flood]) as backend, pool_for(backend) as (upstream, endpoint):
        with pytest.raises(UpstreamProtocolError, match="informational"):
            await call(upstream, endpoint, on_informational=lambda status, headers: None)
        assert endpoint.in_flight == 0 and endpoint.open == 0 and not endpoint.idle


async def test_informational_heads_up_to_the_bound_still_reach_the_answer():
    seen: list[int] = []
    async with hostile([EARLY_HINTS * MAX_INFORMATIONAL + answer(b"final")]) as backend, \
            pool_for(backend) as (upstream, endpoint):
        response, data = await call(upstream, endpoint,
                                    on_informational=lambda status, _: seen.append(status))
        assert response.status == 200 and data == b"final"
        assert seen == [103] * MAX_INFORMATIONAL


async def test_end_to_end_a_decode_flooding_1xx_is_a_502_naming_it(caplog):
    caplog.set_level(logging.WARNING)
    # Never a final head: before the bound, the client would wait for ever.
    async with hostile([EARLY_HINTS * 1000, asyncio.Event()]) as decode, \
            running_proxy(config_for(decode=decode.url)) as proxy:
        reply = await asyncio.wait_for(proxy.request("POST", CHAT, chat()), 10)
        assert reply.status == 502 and reply.json()["error"]["type"] == "upstream_error"
    assert any("informational" in record.getMessage()
               and record.fields.get("backend") == decode.url.rstrip("/").lower()
               for record in caplog.records if hasattr(record, "fields"))


# -- an early answer with the request still being sent


async def test_a_connection_whose_request_is_not_all_sent_is_never_pooled():
    big = {"prompt": "x" * (8 << 20)}
    writers: list[asyncio.StreamWriter] = []
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next((line.split(b":")[1] for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length")), b"0"))
        if length > 1 << 20:  # answer at once, keep the connection, never read on
            writer.write(answer(b'{"error": "too big"}', 413))
            await done.wait()
            return
        await reader.readexactly(length)
        writer.write(answer(b'{"ok": 1}'))
        await done.wait()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_proxy(config_for(decode=f"http://127.0.0.1:{port}")) as proxy:
            reply = await asyncio.wait_for(proxy.request("POST", "/v1/completions", big), 20)
            assert reply.status == 413
            # The next request goes out on a connection of its own and is answered.
            reply = await asyncio.wait_for(proxy.request("GET", "/v1/models"), 10)
            assert reply.status == 200 and reply.body == b'{"ok": 1}'
            assert len(writers) == 2
    finally:
        done.set()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


# -- framing


async def test_a_204_never_carries_a_content_length_to_the_client():
    async with hostile([b"HTTP/1.1 204 No Content\r\ncontent-length: 20\r\n\r\n"]) as decode, \
            running_proxy(config_for(decode=decode.url)) as proxy:
        raw = await raw_exchange(proxy.port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n",
                                 half_close=True)
        head = raw.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 204 ") and b"content-length" not in head


def test_a_chunk_size_line_over_the_bound_is_refused_whole_or_in_pieces():
    line = b"5;" + b"x" * (MAX_LINE + 10) + b"\r\nhello\r\n0\r\n\r\n"
    with pytest.raises(ChunkedError, match="too long"):
        ChunkedDecoder().feed(line)
    decoder = ChunkedDecoder()
    with pytest.raises(ChunkedError, match="too long"):
        decoder.feed(line[:100])
        decoder.feed(line[100:])
    # Within the bound, extensions are read past as before.
    assert b"".join(ChunkedDecoder().feed(b"5;name=value\r\nhello\r\n0\r\n\r\n")) == b"hello"


# -- a decode answer read whole that breaks off


PREFILL_WITH_CACHE = answer(b'{"id": "p", "choices": [], "kv_transfer_params": '
                            b'{"remote_block_ids": [[1]], "remote_engine_id": "e"}, "usage": '
                            b'{"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, '
                            b'"prompt_tokens_details": {"cached_tokens": 3}}}')


@pytest.mark.parametrize("ending", [CLOSE, RESET])
async def test_a_decode_answer_cut_before_any_byte_went_out_is_a_502_counted_as_one(
        ending, caplog):
    caplog.set_level(logging.INFO)
    cut = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n" \
        b'{"id": "d", "choices": [{"index": 0, "message": {"content": "a'
    async with hostile([PREFILL_WITH_CACHE]) as prefill, hostile([cut, ending]) as decode, \
            running_proxy(config_for(prefill=prefill.url, decode=decode.url)) as proxy:
        reply = await proxy.request("POST", CHAT, chat(), headers=[("x-request-id", "cut-7")])
        assert reply.status == 502 and reply.json()["error"]["type"] == "upstream_error"
        metrics = (await proxy.request("GET", "/metrics")).body
        assert b'lowproxy_requests_total{route="generation",status="502"} 1' in metrics
        assert b'status="499"' not in metrics
    access = [record.getMessage() for record in caplog.records
              if record.name == "lowproxy.access" and "cut-7" in record.getMessage()]
    assert access and "status=502" in access[0], access


async def test_a_prefill_answer_in_many_small_chunks_within_the_kept_part_is_read():
    """The chunk bound counts only what is drained past the kept 8 MiB: an answer of
    70,000 small chunks (700 KB) is an answer, not a backend gone wrong."""
    import asyncio

    from helpers import CHAT, ScriptedBackend, chat, config_for, running_proxy

    body = b'{"id":"p","choices":[{"text":"x"}],"kv_transfer_params":null,"pad":"' + \
        b"y" * 700_000 + b'"}'

    async def small_chunks(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(65536)  # the leg's body (small)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        writer.write(b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 10]), body[i:i + 10])
                              for i in range(0, len(body), 10)) + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def decode_answer(request, responder):
        await responder.send_json(200, {"id": "d"})

    server = await asyncio.start_server(small_chunks, "127.0.0.1", 0)
    decode = await ScriptedBackend(decode_answer).start()
    try:
        port = server.sockets[0].getsockname()[1]
        async with running_proxy(config_for(f"http://127.0.0.1:{port}", decode.url())) as proxy:
            reply = await proxy.request("POST", CHAT, chat(), timeout=20)
            assert reply.status == 200
            assert proxy.proxy.metrics.prefill_legs.get("relay", "ok") == 1
    finally:
        server.close()
        await decode.close()


# -- a backend's bytes in an illegal head (session 38's TLS and keys audit)

REFLECTED = b"HTTP/1.1 200 OK\r\nX-Seen-Authorization Bearer SECRET-REFLECTED\r\n\r\n"


@pytest.mark.parametrize("line", [REFLECTED, b"HTTP/1.1 2OO SECRET-REFLECTED\r\n\r\n"])
async def test_an_illegal_prefill_head_is_named_without_the_backends_bytes(caplog, line):
    """h11 quotes the offending line; a backend reflecting the request's authorization
    there put the key into the client's 502 (PD_PROXY_ON_PREFILL_FAILURE=error) and
    the warning. Both now name the fault and the backend, not the bytes."""
    caplog.set_level(logging.DEBUG)
    async with hostile([line, CLOSE]) as prefill, hostile([answer(b"{}")]) as decode, \
            running_proxy(config_for(prefill.url, decode.url,
                                     on_prefill_failure="error")) as proxy:
        reply = await proxy.request("POST", CHAT, chat())
        assert reply.status == 502 and reply.json()["error"]["type"] == "prefill_failed"
        message = reply.json()["error"]["message"]
        assert "illegal" in message and b"SECRET" not in reply.body
    logged = [record.getMessage() + str(getattr(record, "fields", "")) for record in caplog.records]
    assert any("illegal" in text for text in logged), logged
    assert not any("SECRET" in text for text in logged), logged
