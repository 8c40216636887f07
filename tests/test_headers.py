"""What crosses each hop: request headers to the backends, response headers to the client.

Values travel as raw bytes (non-ASCII included), repeated response headers stay
separate lines, hop-by-hop headers (and any named in Connection) stop at the proxy.
"""

from __future__ import annotations

import pytest

from helpers import ScriptedBackend, chat, config_for, pd_setup, running_proxy
from lowproxy.headers import (
    FORWARDED_REQUEST_HEADERS,
    body_framing,
    client_response_head,
    connection_tokens,
    forwarded_request_headers,
    relayed_response_headers,
)

ALLOWED = [
    (b"accept", b"application/json"),
    (b"accept-encoding", b"gzip, br"),
    (b"cache-control", b"no-cache"),
    (b"content-type", b"application/json; charset=utf-8"),
    (b"idempotency-key", b"key-\xc3\xa9-1"),
    (b"if-match", b'"etag-1"'),
    (b"if-none-match", b'"etag-2"'),
    (b"prefer", b"respond-async, wait=5"),
    (b"range", b"bytes=0-99"),
    (b"user-agent", b"caf\xc3\xa9-client/1.0 \xff\xfe"),
    (b"x-request-id", b"req-\xe2\x9c\x93-42"),
]

FORBIDDEN = [
    (b"authorization", b"Bearer client-secret"),
    (b"cookie", b"session=abc"),
    (b"x-prefiller-host-port", b"10.0.0.9:8000"),
    (b"x-forwarded-for", b"1.2.3.4"),
    (b"x-forwarded-host", b"evil.example"),
    (b"forwarded", b"for=1.2.3.4"),
    (b"proxy-authorization", b"Basic Zm9vOmJhcg=="),
    (b"te", b"trailers"),
    (b"x-admin-api-key", b"guess"),
    (b"x-custom", b"anything"),
    (b"content-encoding", b"identity"),
    (b"upgrade", b"websocket"),
]

FORBIDDEN_NAMES = {name for name, _ in FORBIDDEN} | {b"x-hop-named", b"keep-alive"}


# -- pure


def test_allow_list_is_exactly_the_gco_one():
    assert FORWARDED_REQUEST_HEADERS == {name for name, _ in ALLOWED}


def test_forwarded_request_headers_keep_allowed_ones_in_order_as_bytes():
    headers = [FORBIDDEN[0], ALLOWED[9], FORBIDDEN[1], ALLOWED[0], ALLOWED[9]]
    assert forwarded_request_headers(headers) == [ALLOWED[9], ALLOWED[0], ALLOWED[9]]


def test_forwarded_request_headers_drop_connection_named_ones():
    headers = [(b"connection", b"keep-alive, Prefer"), (b"prefer", b"wait=1"),
               (b"accept", b"*/*")]
    assert forwarded_request_headers(headers) == [(b"accept", b"*/*")]


def test_connection_tokens_are_lowercased_and_split():
    tokens = connection_tokens([(b"Connection", b" Keep-Alive ,X-Foo,, "),
                                (b"connection", b"x-bar")])
    assert tokens == {b"keep-alive", b"x-foo", b"x-bar"}


def test_relayed_response_headers_strip_hop_by_hop_and_keep_repeats():
    upstream = [
        (b"Content-Type", b"application/json"),
        (b"Set-Cookie", b"a=1"),
        (b"Connection", b"x-hop-named, close"),
        (b"x-hop-named", b"gone"),
        (b"set-cookie", b"b=2"),
        (b"keep-alive", b"timeout=5"),
        (b"proxy-authenticate", b"Basic"),
        (b"proxy-authorization", b"x"),
        (b"te", b"trailers"),
        (b"trailer", b"x-checksum"),
        (b"transfer-encoding", b"chunked"),
        (b"upgrade", b"h2c"),
        (b"content-length", b"12"),
        (b"x-utf8", b"\xc3\xa9t\xc3\xa9"),
    ]
    assert relayed_response_headers(upstream) == [
        (b"content-type", b"application/json"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
        (b"x-utf8", b"\xc3\xa9t\xc3\xa9"),
    ]


# -- over sockets: request headers


def request_headers_sent():
    return [*ALLOWED, *FORBIDDEN, (b"connection", b"keep-alive, x-hop-named"),
            (b"x-hop-named", b"v"), (b"keep-alive", b"300")]


def assert_only_allowed(received, prefill=False):
    names = [name for name, _ in received.headers]
    for name, value in ALLOWED:
        if prefill and name == b"accept-encoding":  # its answer is the proxy's to read
            assert received.header(name.decode()) is None
            continue
        assert received.header(name.decode()) == value, name
    assert not FORBIDDEN_NAMES & set(names), names
    assert names.count(b"x-request-id") == 1


async def test_generation_legs_get_only_allowed_headers_as_raw_bytes():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                    headers=request_headers_sent())
        assert reply.status == 200, reply.body
        [pf], [dc] = prefill.received, decode.received
        assert_only_allowed(pf, prefill=True)
        assert_only_allowed(dc)
        assert dc.header("host") == f"127.0.0.1:{decode.port}".encode()


async def test_passthrough_get_and_post_get_only_allowed_headers():
    async with pd_setup() as (proxy, prefill, decode):
        await proxy.request("GET", "/v1/models", headers=request_headers_sent())
        await proxy.request("POST", "/v1/other", {"a": 1}, headers=request_headers_sent())
        assert prefill.received == []
        get, post = decode.received
        assert_only_allowed(get)
        assert_only_allowed(post)


async def test_connection_named_allowed_header_does_not_cross():
    async with pd_setup() as (proxy, prefill, decode):
        await proxy.request("GET", "/v1/models", headers=[
            (b"connection", b"keep-alive, user-agent, prefer"),
            (b"user-agent", b"hop-only"), (b"prefer", b"wait=1"), (b"accept", b"*/*")])
        [get] = decode.received
        assert get.header("user-agent") is None and get.header("prefer") is None
        assert get.header("accept") == b"*/*"


async def test_proxy_adds_no_accept_encoding_of_its_own():
    async with pd_setup() as (proxy, prefill, decode):
        await proxy.request("POST", "/v1/chat/completions", chat())
        await proxy.request("GET", "/v1/models")
        assert prefill.received and decode.received
        for received in prefill.received + decode.received:
            assert received.header("accept-encoding") is None, received.headers


async def test_client_accept_encoding_is_forwarded_verbatim():
    async with pd_setup() as (proxy, prefill, decode):
        await proxy.request("GET", "/v1/models", headers=[("Accept-Encoding", "identity;q=0")])
        assert decode.received[0].header("accept-encoding") == b"identity;q=0"


async def test_prefill_gets_no_accept_encoding_and_decode_the_clients():
    """Prefill's answer is the proxy's to read: behind a compressing hop, a gzip one
    would be no answer at all (decode recomputing every prompt). Decode's answer is
    the client's, so it gets what the client accepts, as from the GCO proxy."""
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                    headers=[("Accept-Encoding", "gzip, deflate, br")])
        assert reply.status == 200
        [pf], [dc] = prefill.received, decode.received
        assert pf.header("accept-encoding") is None, pf.headers
        assert pf.header("x-request-id") and pf.header("user-agent") == \
            dc.header("user-agent")  # the rest as before
        assert dc.header("accept-encoding") == b"gzip, deflate, br"


async def test_a_request_id_is_added_when_the_client_sent_none():
    async with pd_setup() as (proxy, prefill, decode):
        await proxy.request("POST", "/v1/chat/completions", chat())
        [pf], [dc] = prefill.received, decode.received
        assert pf.header("x-request-id") and pf.header("x-request-id") == dc.header("x-request-id")


# -- over sockets: response headers


RESPONSE_EXTRA = [
    (b"set-cookie", b"a=1; Path=/"),
    (b"x-dup", b"one"),
    (b"set-cookie", b"b=2; Path=/"),
    (b"x-dup", b"two"),
    (b"x-utf8", b"caf\xc3\xa9 \xe2\x9c\x93 \xff"),
    (b"connection", b"x-hop-named"),
    (b"x-hop-named", b"must not cross"),
    (b"keep-alive", b"timeout=5"),
    (b"proxy-authenticate", b"Basic realm=x"),
    (b"trailer", b"x-checksum"),
    (b"te", b"trailers"),
    (b"upgrade", b"h2c"),
]

STRIPPED = {b"x-hop-named", b"keep-alive", b"proxy-authenticate", b"trailer", b"te",
            b"upgrade", b"connection"}


def assert_response_headers_relayed(reply):
    assert reply.header_values("set-cookie") == [b"a=1; Path=/", b"b=2; Path=/"]
    assert reply.header_values("x-dup") == [b"one", b"two"]
    assert reply.header("x-utf8") == b"caf\xc3\xa9 \xe2\x9c\x93 \xff"
    names = {name.lower() for name, _ in reply.headers}
    assert not STRIPPED & names, reply.headers


@pytest.mark.parametrize("stream", [False, True])
async def test_generation_response_headers_relayed_raw_with_repeats(stream):
    async with pd_setup() as (proxy, prefill, decode):
        decode.faults.extra_headers = list(RESPONSE_EXTRA)
        reply = await proxy.request("POST", "/v1/chat/completions", chat(stream=stream))
        assert reply.status == 200 and reply.complete, reply.body
        assert_response_headers_relayed(reply)
        if stream:
            assert reply.body.endswith(b"data: [DONE]\n\n")
        else:
            assert reply.json()["object"] == "chat.completion"


async def test_prefill_response_headers_never_reach_the_client():
    async with pd_setup() as (proxy, prefill, decode):
        prefill.faults.extra_headers = [(b"x-from-prefill", b"1"), (b"set-cookie", b"p=1")]
        reply = await proxy.request("POST", "/v1/chat/completions", chat())
        assert reply.status == 200
        assert reply.header("x-from-prefill") is None and reply.header("set-cookie") is None


async def test_passthrough_response_headers_relayed_raw():
    async def answer(request, responder):
        await responder.send_bytes(200, b'{"ok":true}',
                                   [(b"content-type", b"application/json"), *RESPONSE_EXTRA])

    backend = await ScriptedBackend(answer).start()
    try:
        async with running_proxy(config_for((), backend.url())) as proxy:
            reply = await proxy.request("GET", "/v1/models")
            assert reply.status == 200 and reply.json() == {"ok": True}
            assert_response_headers_relayed(reply)
    finally:
        await backend.close()


def test_client_response_head_content_type_and_length():
    upstream = [(b"Content-Type", b"application/x-ndjson"), (b"Content-Length", b"12"),
                (b"X-Dup", b"1"), (b"X-Dup", b"2")]
    headers, length = client_response_head(upstream, streamed=False)
    assert length == 12
    assert headers == [(b"x-dup", b"1"), (b"x-dup", b"2"),
                       (b"content-type", b"application/x-ndjson")]
    headers, length = client_response_head(upstream, streamed=True)
    assert headers[-1] == (b"content-type", b"text/event-stream")
    headers, length = client_response_head([(b"transfer-encoding", b"chunked")], False)
    assert length is None and headers == [(b"content-type", b"application/json")]


def test_client_response_head_ignores_a_length_beside_transfer_encoding():
    # RFC 9112 6.3: Transfer-Encoding overrides Content-Length; a relayed length
    # would frame the de-chunked body by a number it does not match.
    for upstream in ([(b"Content-Length", b"5"), (b"Transfer-Encoding", b"chunked")],
                     [(b"transfer-encoding", b"chunked"), (b"content-length", b"99")]):
        headers, length = client_response_head(upstream, streamed=False)
        assert length is None
        assert headers == [(b"content-type", b"application/json")]


def test_body_framing_transfer_encoding_beats_content_length():
    assert body_framing([(b"Content-Length", b"7")]) == (7, False)
    assert body_framing([(b"content-length", b"7"), (b"Transfer-Encoding", b"chunked")]) == (
        None, True)
    assert body_framing([(b"transfer-encoding", b"chunked")]) == (None, True)
    assert body_framing([]) == (None, False)
