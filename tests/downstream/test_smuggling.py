"""Request smuggling attempts: the backend only ever sees requests the client framed.

Each ambiguous message is refused with a 400 and the connection closed, so a
request hidden behind it (``GET /smuggled``) is never parsed, let alone
forwarded. Unambiguous messages are re-framed: the backend gets one request
per client request, with the proxy's own Content-Length and no
Transfer-Encoding, whatever the body contains. No attempt earns a 5xx.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers import chat, parse_replies, pd_setup, raw_exchange

HIDDEN = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
CHUNKED = b"transfer-encoding: chunked\r\n"


def head(method: bytes = b"POST", target: bytes = b"/v1/models", extra: bytes = b"",
         version: bytes = b"1.1") -> bytes:
    return method + b" " + target + b" HTTP/" + version + b"\r\nHost: x\r\n" + extra + b"\r\n"


AMBIGUOUS = {
    "CL.TE": head(extra=b"content-length: 6\r\n" + CHUNKED) + b"0\r\n\r\n" + HIDDEN,
    "TE.CL": head(extra=CHUNKED + b"content-length: 4\r\n") + b"5c\r\n" + HIDDEN + b"\r\n0\r\n\r\n",
    "CL.CL conflicting": head(extra=b"content-length: 0\r\ncontent-length: 37\r\n") + HIDDEN,
    "CL.CL equal": head(extra=b"content-length: 0\r\ncontent-length: 0\r\n") + HIDDEN,
    "CL list": head(extra=b"content-length: 0, 37\r\n") + HIDDEN,
    "TE obfuscated": head(extra=b"transfer-encoding: xchunked\r\n") + HIDDEN,
    "TE.TE": head(extra=CHUNKED + b"transfer-encoding: identity\r\n") + b"0\r\n\r\n" + HIDDEN,
    "TE list": head(extra=b"transfer-encoding: chunked, identity\r\n") + HIDDEN,
    "TE in HTTP/1.0": head(extra=CHUNKED, version=b"1.0") + b"0\r\n\r\n" + HIDDEN,
    "TE space before colon": head(extra=b"transfer-encoding : chunked\r\n") + b"0\r\n\r\n"
    + HIDDEN,
    "TE vertical tab": head(extra=b"transfer-encoding:\x0bchunked\r\n") + b"0\r\n\r\n" + HIDDEN,
    "obs-fold TE": head(extra=b"x-a: b\r\ntransfer-encoding:\r\n chunked\r\n") + b"0\r\n\r\n"
    + HIDDEN,
    "obs-fold CL": head(extra=b"x-a: b\r\n content-length: 37\r\n") + HIDDEN,
    "bare LF before CL": head(extra=b"x-foo: a\ncontent-length: 37\r\n") + HIDDEN,
    "bare LF before TE": head(extra=b"x-foo: a\n" + CHUNKED) + b"0\r\n\r\n" + HIDDEN,
    "bare LF request line": b"POST /v1/models HTTP/1.1\nHost: x\r\ncontent-length: 37\r\n\r\n"
    + HIDDEN,
    "bare LF head end": b"POST /v1/models HTTP/1.1\r\nHost: x\r\ncontent-length: 37\r\n\n"
    + HIDDEN,
    "chunk size not hex": head(extra=CHUNKED) + b"zz\r\n" + HIDDEN,
    "chunk size negative": head(extra=CHUNKED) + b"-1\r\n" + HIDDEN,
    "chunk size 0x": head(extra=CHUNKED) + b"0x25\r\n" + HIDDEN,
    "chunk size overflow": head(extra=CHUNKED) + b"1" * 40 + b"\r\n" + HIDDEN,
    "chunk longer than its size": head(extra=CHUNKED) + b"1\r\nab\r\n0\r\n\r\n" + HIDDEN,
    "chunk without its CRLF": head(extra=CHUNKED) + b"1\r\na0\r\n\r\n" + HIDDEN,
}


@pytest.mark.parametrize("case", sorted(AMBIGUOUS))
async def test_ambiguous_framing_is_refused_and_nothing_behind_it_is_read(case):
    async with pd_setup() as (proxy, prefill, decode):
        raw = await raw_exchange(proxy.port, AMBIGUOUS[case])
        replies = parse_replies(raw)
        assert [r.status for r in replies] == [400], (case, raw)
        assert replies[0].complete and replies[0].header("connection") == b"close"
        assert decode.received == [] and prefill.received == []
        # The proxy goes on serving.
        reply = await proxy.request("POST", "/v1/chat/completions", chat())
        assert reply.status == 200
        assert [r.path for r in decode.received] == ["/v1/chat/completions"]


async def test_request_hidden_in_a_content_length_body_stays_a_body():
    async with pd_setup() as (proxy, prefill, decode):
        wire = head(b"GET", extra=b"content-length: %d\r\nconnection: close\r\n" % len(HIDDEN))
        raw = await raw_exchange(proxy.port, wire + HIDDEN)
        assert [r.status for r in parse_replies(raw)] == [200]
        [seen] = decode.received
        assert (seen.method, seen.path, seen.raw_body) == ("GET", "/v1/models", HIDDEN)
        assert seen.header("content-length") == str(len(HIDDEN)).encode()


async def test_request_hidden_in_a_chunked_body_is_re_framed_as_a_body():
    async with pd_setup() as (proxy, prefill, decode):
        wire = (head(b"GET", extra=CHUNKED + b"connection: close\r\n")
                + b"%x\r\n%s\r\n0\r\n\r\n" % (len(HIDDEN), HIDDEN))
        raw = await raw_exchange(proxy.port, wire)
        assert [r.status for r in parse_replies(raw)] == [200]
        [seen] = decode.received
        assert (seen.method, seen.path, seen.raw_body) == ("GET", "/v1/models", HIDDEN)
        # The backend sees the proxy's framing, not the client's.
        assert seen.header("transfer-encoding") is None
        assert seen.header("content-length") == str(len(HIDDEN)).encode()


async def test_pipelined_requests_are_served_in_order_as_the_client_framed_them():
    async with pd_setup() as (proxy, prefill, decode):
        body = b'{"model":"m","prompt":"GET /smuggled HTTP/1.1"}'
        wire = (head(b"POST", b"/v1/echo", b"content-length: %d\r\n" % len(body)) + body
                + head(b"GET", b"/v1/models", CHUNKED) + b"0\r\n\r\n"
                + head(b"GET", b"/v1/models", b"connection: close\r\n"))
        raw = await raw_exchange(proxy.port, wire)
        assert [r.status for r in parse_replies(raw)] == [200, 200, 200]
        assert [(r.method, r.path) for r in decode.received] == [
            ("POST", "/v1/echo"), ("GET", "/v1/models"), ("GET", "/v1/models")]
        assert decode.received[0].body == {"model": "m", "prompt": "GET /smuggled HTTP/1.1"}


async def test_body_shorter_than_declared_is_never_forwarded():
    async with pd_setup(header_timeout=0.3) as (proxy, prefill, decode):
        # The client promises 100 bytes and sends a request's worth: the proxy waits
        # for the rest (408), it never treats HIDDEN as a request or sends a part on.
        raw = await raw_exchange(proxy.port, head(extra=b"content-length: 100\r\n") + HIDDEN)
        assert [r.status for r in parse_replies(raw)] == [408]
        assert decode.received == []


async def test_client_framing_headers_never_reach_the_backend():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request(
            "POST", "/v1/chat/completions", chat(),
            headers=[("connection", "keep-alive, x-drop-me"), ("x-drop-me", "1"),
                     ("te", "trailers"), ("upgrade", "h2c"), ("keep-alive", "timeout=5")])
        assert reply.status == 200
        for leg in prefill.received + decode.received:
            names = {name for name, _ in leg.headers}
            assert not names & {b"transfer-encoding", b"connection", b"te", b"upgrade",
                                b"keep-alive", b"x-drop-me"}, names
            assert leg.header("content-length") == str(len(leg.raw_body)).encode()


async def test_no_client_header_or_target_makes_the_proxy_connect_elsewhere():
    """Host, absolute-form targets, forwarding headers and an unallowed
    x-prefiller-host-port all name a trap server; the proxy never connects to it."""
    touched = []

    async def trap(reader, writer):
        touched.append(await reader.read(1024))
        writer.close()

    server = await asyncio.start_server(trap, "127.0.0.1", 0)
    trap_at = b"127.0.0.1:%d" % server.sockets[0].getsockname()[1]
    try:
        async with pd_setup() as (proxy, prefill, decode):
            hostile = [(b"x-prefiller-host-port", trap_at), (b"x-forwarded-host", trap_at),
                       (b"forwarded", b"host=" + trap_at),
                       (b"x-original-url", b"http://" + trap_at)]
            for target in (b"/v1/chat/completions",
                           b"http://" + trap_at + b"/v1/chat/completions"):
                wire = (b"POST " + target + b" HTTP/1.1\r\nHost: " + trap_at + b"\r\n"
                        + b"".join(name + b": " + value + b"\r\n" for name, value in hostile)
                        + b"content-type: application/json\r\ncontent-length: %d\r\n"
                        b"connection: close\r\n\r\n")
                body = json.dumps(chat()).encode()
                raw = await raw_exchange(proxy.port, wire % len(body) + body)
                assert parse_replies(raw)[0].status == 200, raw
            assert len(decode.received) == 2 and len(prefill.received) == 2
            for leg in decode.received + prefill.received:
                assert trap_at not in leg.header("host")
            await asyncio.sleep(0.05)
            assert touched == []
    finally:
        server.close()


async def test_a_malformed_header_line_is_refused_without_its_bytes_in_the_answer():
    """h11 quotes the line it cannot parse; a header an ingress added (a key) came
    back in the 400's body. The body keeps h11's words, not the client's bytes."""
    async with pd_setup() as (proxy, prefill, decode):
        wire = head(extra=b"Authorization: Bearer CLIENT-SECRET\x00\r\n") + b"{}"
        replies = parse_replies(await raw_exchange(proxy.port, wire))
        assert [r.status for r in replies] == [400]
        assert b"malformed request" in replies[0].body and b"SECRET" not in replies[0].body
        assert decode.received == []
