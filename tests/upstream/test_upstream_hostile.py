"""Backends that break HTTP on purpose: the backend is the attacker.

A raw TCP backend reads each request whole and then plays the script's step
for it: bytes to write (a response, a second response it was never asked for,
stray bytes), a hang-up (FIN or reset), or a wait for the test's signal (to
write while the connection sits idle in the pool). The tests assert what the
proxy must guarantee: bytes past the end of a response are never read as the
next answer (RFC 9112 section 6.3), a request the backend may have acted on is
never sent twice (RFC 9110 section 9.2.2), Transfer-Encoding frames a body
whatever Content-Length says, and 1xx responses reach the caller without
breaking the exchange. Each is checked at the Upstream level and, where the
in-process proxy makes it easy, end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpcore
import pytest

from helpers import (
    RawServer,
    chat,
    config_for,
    raw_exchange,
    read_request,
    running_proxy,
    wait_until,
)
from lowproxy.config import Config, parse_endpoint
from lowproxy.tls import TrustStore
from lowproxy.upstream import Endpoint
from lowproxy.upstream.pool import (
    Upstream,
    UpstreamClosed,
    UpstreamError,
    UpstreamNotRetried,
    UpstreamProtocolError,
    UpstreamResponse,
)
from lowproxy.upstream.stream import AsyncioBackend

RESET = "reset"  # abort the connection (RST) without answering
CLOSE = "close"  # close it (FIN) without answering more


def answer(body: bytes, status: int = 200, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status, len(body), extra, body))


def chunked_answer(*pieces: bytes, extra: bytes = b"") -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n%s\r\n%s" % (extra, body))


FORGED = answer(b'{"forged": true}')  # what a stray second response says
REAL = answer(b'{"real": true}')


class Hostile(RawServer):
    """A raw backend: the n-th request it reads gets ``script[n]`` (the last step repeats).

    A step is a list of actions: bytes (written and drained, each its own
    segment), RESET, CLOSE, an asyncio.Event (wait for it), or a callable
    (called: the test learns the backend got there).
    """

    def __init__(self, *script: list[Any]) -> None:
        super().__init__()
        self.script = script
        self.requests: list[tuple[int, bytes]] = []  # (connection number, head)
        self.bodies: list[bytes] = []

    def methods(self) -> list[bytes]:
        return [head.split(b" ", 1)[0] for _, head in self.requests]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    number: int) -> None:
        while True:
            head, body = await read_request(reader)
            self.bodies.append(body)
            step = self.script[min(len(self.requests), len(self.script) - 1)]
            self.requests.append((number, head))
            for action in step:
                if isinstance(action, bytes):
                    writer.write(action)
                    await writer.drain()
                elif action == RESET:
                    writer.transport.abort()
                    return
                elif action == CLOSE:
                    return
                elif isinstance(action, asyncio.Event):
                    await action.wait()
                else:
                    action()


@contextlib.asynccontextmanager
async def hostile(*script: list[Any]) -> AsyncIterator[Hostile]:
    backend = await Hostile(*script).start()
    try:
        yield backend
    finally:
        await backend.close()


@contextlib.asynccontextmanager
async def pool_for(backend: Hostile, **overrides: Any
                   ) -> AsyncIterator[tuple[Upstream, Endpoint]]:
    """An Upstream and its Endpoint for ``backend``, as the proxy builds them."""
    spec = parse_endpoint(backend.url)
    upstream = Upstream(Config(decode=(spec,), **overrides), TrustStore(None))
    endpoint = Endpoint(spec)
    try:
        yield upstream, endpoint
    finally:
        upstream.close_idle(endpoint)


async def call(upstream: Upstream, endpoint: Endpoint, method: bytes = b"POST",
               headers: list[tuple[bytes, bytes]] | None = None,
               **kw: Any) -> tuple[UpstreamResponse, bytes]:
    body = b'{"prompt": "x"}' if method == b"POST" else None
    response = await upstream.request(endpoint, method, b"/v1/x", headers or [], body, **kw)
    try:
        data = await response.read(1 << 20)
    finally:
        await response.aclose()
    return response, data


def head_only(status: int, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: 7\r\n%s\r\n" % (status, extra)


# -- bytes past the end of a response


# (method, the first answer, what that answer's body is) for every way a body ends.
OVERRUNS = {
    "length-framed": (b"POST", answer(b"ok") + FORGED, b"ok"),
    "length-framed-stray": (b"POST", answer(b"ok") + b"garbage\r\n", b"ok"),
    "chunked": (b"POST", chunked_answer(b"data: 1\n\n") + FORGED, b"data: 1\n\n"),
    "head": (b"HEAD", head_only(200) + FORGED, b""),
    "204": (b"POST", b"HTTP/1.1 204 No Content\r\n\r\n" + FORGED, b""),
    "304": (b"GET", b"HTTP/1.1 304 Not Modified\r\netag: \"1\"\r\n\r\n" + FORGED, b""),
}


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "two-writes"])
@pytest.mark.parametrize("kind", list(OVERRUNS))
async def test_a_response_overrun_is_never_read_as_the_next_answer(kind, split):
    method, wire, body = OVERRUNS[kind]
    end = wire.index(FORGED) if FORGED in wire else wire.index(b"garbage")
    first = [wire[:end], wire[end:]] if split else [wire]
    async with hostile(first, [REAL]) as backend, pool_for(backend) as (upstream, endpoint):
        response, data = await call(upstream, endpoint, method)
        assert data == body  # the answer itself is whole ...
        assert not endpoint.idle  # ... but its connection is never reused
        await wait_until(lambda: endpoint.open == 0, what="overrun connection closed")
        response, data = await call(upstream, endpoint, b"POST")
        assert response.status == 200 and data == b'{"real": true}'
        assert backend.connections == 2
        assert [n for n, _ in backend.requests] == [1, 2]


async def test_bytes_arriving_after_the_body_but_before_close_retire_the_connection():
    wrote = asyncio.Event()
    async with hostile([answer(b"ok"), FORGED, wrote.set], [REAL]) as backend, \
            pool_for(backend) as (upstream, endpoint):
        response = await upstream.request(endpoint, b"POST", b"/v1/x", [], b"{}")
        assert await response.read(100) == b"ok"
        await wrote.wait()
        stream = response._pooled.stream  # the forged bytes are in its buffer now
        assert stream is not None
        await wait_until(lambda: stream.bytes_received >= len(answer(b"ok") + FORGED),
                         what="forged bytes received")
        await response.aclose()
        assert not endpoint.idle and endpoint.open == 0
        _, data = await call(upstream, endpoint)
        assert data == b'{"real": true}' and backend.connections == 2


@pytest.mark.parametrize("late", [FORGED, CLOSE, RESET], ids=["stray", "fin", "reset"])
async def test_an_idle_pooled_connection_is_dropped_when_anything_arrives(late):
    pooled = asyncio.Event()
    async with hostile([answer(b"ok"), pooled, late], [REAL]) as backend, \
            pool_for(backend) as (upstream, endpoint):
        _, data = await call(upstream, endpoint)
        assert data == b"ok"
        assert len(endpoint.idle) == 1 and endpoint.open == 1  # pooled, clean so far
        pooled.set()  # now the backend writes (or hangs up) on the idle connection
        # Dropped when it arrives, by the connection's callback: no checkout, no sweep.
        await wait_until(lambda: not endpoint.idle and endpoint.open == 0,
                         what="idle connection dropped on arrival")
        _, data = await call(upstream, endpoint)
        assert data == b'{"real": true}'
        assert backend.connections == 2 and len(backend.requests) == 2


# -- no automatic retry of a request the backend may have received


@pytest.mark.parametrize("hang_up", [RESET, CLOSE])
async def test_a_post_is_not_sent_twice_when_the_reused_connection_dies_after_it(hang_up):
    async with hostile([answer(b"ok")], [hang_up], [REAL]) as backend, \
            pool_for(backend) as (upstream, endpoint):
        await call(upstream, endpoint)
        assert len(endpoint.idle) == 1
        with pytest.raises(UpstreamNotRetried) as caught:
            await call(upstream, endpoint)
        error = caught.value
        assert isinstance(error, UpstreamProtocolError) and isinstance(error, UpstreamError)
        assert error.reason == "protocol" and error.request_sent
        assert "after the request was sent" in error.detail and "not retried" in error.detail
        assert error.endpoint is endpoint
        assert backend.methods() == [b"POST", b"POST"]  # the second one exactly once
        assert backend.connections == 1
        assert endpoint.in_flight == 0 and endpoint.open == 0


@pytest.mark.parametrize("method, headers", [
    (b"GET", []), (b"HEAD", []), (b"OPTIONS", []),
    (b"POST", [(b"idempotency-key", b"k-1")]),
], ids=["GET", "HEAD", "OPTIONS", "POST-idempotency-key"])
async def test_a_replayable_request_is_retried_once_on_a_fresh_connection(method, headers):
    final = head_only(200) if method == b"HEAD" else REAL
    async with hostile([answer(b"ok")], [RESET], [final]) as backend, \
            pool_for(backend) as (upstream, endpoint):
        await call(upstream, endpoint)
        response, data = await call(upstream, endpoint, method, headers)
        assert response.status == 200
        assert data == (b"" if method == b"HEAD" else b'{"real": true}')
        assert backend.methods() == [b"POST", method, method]
        assert [n for n, _ in backend.requests] == [1, 1, 2]


async def test_a_retried_request_that_fails_again_is_not_tried_a_third_time():
    async with hostile([answer(b"ok")], [RESET]) as backend, \
            pool_for(backend) as (upstream, endpoint):
        await call(upstream, endpoint)
        with pytest.raises(UpstreamClosed) as caught:
            await call(upstream, endpoint, b"GET")
        assert not isinstance(caught.value, UpstreamNotRetried)
        assert backend.methods() == [b"POST", b"GET", b"GET"]
        assert endpoint.in_flight == 0 and endpoint.open == 0


async def test_a_fresh_connection_is_never_retried():
    # Not the keep-alive race: a backend that takes a request and hangs up.
    async with hostile([RESET]) as backend, pool_for(backend) as (upstream, endpoint):
        with pytest.raises(UpstreamClosed) as caught:
            await call(upstream, endpoint, b"GET")
        assert caught.value.request_sent
        assert "closed the connection after the request was sent" in caught.value.detail
        assert backend.methods() == [b"GET"]


async def test_a_response_that_started_is_not_retried_even_for_a_get():
    async with hostile([answer(b"ok")], [b"HTTP/1.1 200 OK\r\ncontent-le", CLOSE],
                       [REAL]) as backend, pool_for(backend) as (upstream, endpoint):
        await call(upstream, endpoint)
        with pytest.raises(UpstreamProtocolError) as caught:
            await call(upstream, endpoint, b"GET")
        assert not isinstance(caught.value, UpstreamClosed)  # it answered, then broke
        assert backend.methods() == [b"POST", b"GET"]


async def test_a_post_on_a_connection_the_backend_closed_while_idle_goes_out_once():
    async with hostile([answer(b"ok"), CLOSE], [REAL]) as backend, \
            pool_for(backend) as (upstream, endpoint):
        await call(upstream, endpoint)
        await wait_until(lambda: endpoint.open == 0, what="closed idle connection dropped")
        _, data = await call(upstream, endpoint)
        assert data == b'{"real": true}'
        assert backend.methods() == [b"POST", b"POST"]
        assert [n for n, _ in backend.requests] == [1, 2]


async def test_bytes_written_after_the_backend_hung_up_are_never_sent():
    """The stream holds small writes until the first read: a hang-up that comes
    before then means the request never left, which makes a retry safe."""
    received: list[bytes] = []
    accepted = asyncio.Event()

    async def half_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write_eof()
        accepted.set()
        received.append(await reader.read())
        writer.close()

    server = await asyncio.start_server(half_close, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
        await stream.write(b"POST / HTTP/1.1\r\n")  # held back, not yet sent
        await accepted.wait()
        await wait_until(lambda: stream.at_eof, what="the backend's FIN")
        assert await stream.read(1024) == b""  # the first read finds the hang-up ...
        assert stream.bytes_sent == 0  # ... and the held bytes were dropped, not sent
        with pytest.raises(httpcore.WriteError):
            await stream.write(b"more")
        await wait_until(lambda: received, what="backend saw the close")
        assert received == [b""]
        stream.close()
    finally:
        server.close()


# -- Content-Length beside Transfer-Encoding


CL_AND_TE = chunked_answer(b"hello ", b"world", extra=b"content-length: 3\r\n")


async def test_transfer_encoding_frames_the_body_whatever_content_length_says():
    async with hostile([CL_AND_TE], [REAL]) as backend, pool_for(backend) as (upstream, endpoint):
        response, data = await call(upstream, endpoint)
        assert data == b"hello world"
        assert not any(name.lower() == b"content-length" for name, _ in response.headers)
        assert len(endpoint.idle) == 1  # framed as h11 framed it: the connection is clean
        _, data = await call(upstream, endpoint)
        assert data == b'{"real": true}' and backend.connections == 1


ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/embeddings", {"input": "x"}),
          ("POST", "/v1/chat/completions", chat())]
ROUTE_IDS = ["passthrough-get", "passthrough-post", "generation"]


@pytest.mark.parametrize("method, path, body", ROUTES, ids=ROUTE_IDS)
async def test_end_to_end_a_length_beside_chunked_never_reaches_the_client(method, path, body):
    async with hostile([CL_AND_TE]) as backend, \
            running_proxy(config_for(decode=backend.url)) as proxy:
        reply = await proxy.request(method, path, body)
    assert reply.status == 200 and reply.complete
    assert reply.body == b"hello world"
    assert reply.header("content-length") is None
    assert reply.header("transfer-encoding") == b"chunked"


# -- the same attacks end to end


@pytest.mark.parametrize("method, path, body", ROUTES, ids=ROUTE_IDS)
async def test_end_to_end_a_second_response_never_answers_the_next_request(method, path, body):
    async with hostile([answer(b'{"first": 1}') + FORGED], [REAL]) as backend, \
            running_proxy(config_for(decode=backend.url)) as proxy:
        first = await proxy.request(method, path, body)
        second = await proxy.request(method, path, body)
    assert first.status == 200 and first.body == b'{"first": 1}'
    assert second.status == 200 and second.body == b'{"real": true}'
    assert backend.connections == 2


@pytest.mark.parametrize("path, body", [("/v1/embeddings", {"input": "x"}),
                                        ("/v1/chat/completions", chat())],
                         ids=["passthrough", "generation"])
async def test_end_to_end_a_post_reset_after_it_was_read_is_502_and_not_resent(path, body):
    async with hostile([answer(b'{"first": 1}')], [RESET], [REAL]) as backend, \
            running_proxy(config_for(decode=backend.url)) as proxy:
        assert (await proxy.request("POST", path, body)).status == 200
        reply = await proxy.request("POST", path, body)
        assert reply.status == 502
        assert reply.json()["error"]["type"] == "upstream_error"
        assert backend.methods() == [b"POST", b"POST"]
        # The pool is intact for the next request, on a fresh connection.
        after = await proxy.request("POST", path, body)
        assert after.status == 200 and after.body == b'{"real": true}'
        assert backend.methods() == [b"POST", b"POST", b"POST"]


async def test_end_to_end_a_get_reset_on_a_reused_connection_is_retried():
    async with hostile([answer(b'{"first": 1}')], [RESET], [REAL]) as backend, \
            running_proxy(config_for(decode=backend.url)) as proxy:
        assert (await proxy.request("GET", "/v1/models")).status == 200
        reply = await proxy.request("GET", "/v1/models")
    assert reply.status == 200 and reply.body == b'{"real": true}'
    assert backend.methods() == [b"GET", b"GET", b"GET"]
    assert backend.connections == 2


# -- 1xx before the final answer


EARLY_HINTS = (b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n"
               b"link: </b.js>; rel=preload\r\n\r\n")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def recorder() -> tuple[list[tuple[int, list[tuple[bytes, bytes]]]], Callable[..., None]]:
    seen: list[tuple[int, list[tuple[bytes, bytes]]]] = []
    return seen, lambda status, headers: seen.append((status, headers))


@pytest.mark.parametrize("pieces", [
    [CONTINUE + EARLY_HINTS + answer(b"final")],
    [CONTINUE, EARLY_HINTS, answer(b"final")],
    [CONTINUE + EARLY_HINTS[:30], EARLY_HINTS[30:-1], EARLY_HINTS[-1:] + answer(b"final")],
], ids=["one-write", "one-write-each", "split-inside-heads"])
async def test_informational_responses_reach_the_callback_before_the_answer(pieces):
    async with hostile(pieces) as backend, pool_for(backend) as (upstream, endpoint):
        for _ in range(2):
            seen, on_informational = recorder()
            response, data = await call(upstream, endpoint, on_informational=on_informational)
            assert seen == [(100, []), (103, [(b"link", b"</a.css>; rel=preload"),
                                             (b"link", b"</b.js>; rel=preload")])]
            assert response.status == 200 and data == b"final"
        assert backend.connections == 1  # the 1xx left the connection reusable


async def test_informational_before_a_chunked_stream_and_without_a_callback():
    async with hostile([EARLY_HINTS + chunked_answer(b"data: 1\n\n", b"data: 2\n\n")]) \
            as backend, pool_for(backend) as (upstream, endpoint):
        seen, on_informational = recorder()
        _, data = await call(upstream, endpoint, on_informational=on_informational)
        assert [status for status, _ in seen] == [103]
        assert data == b"data: 1\n\ndata: 2\n\n"
        _, data = await call(upstream, endpoint)  # no callback: 1xx skipped quietly
        assert data == b"data: 1\n\ndata: 2\n\n"
        assert backend.connections == 1


async def test_a_callback_that_raises_ends_the_exchange_and_its_connection():
    def refuse(status: int, headers: list[tuple[bytes, bytes]]) -> None:
        raise RuntimeError("client gone")

    async with hostile([EARLY_HINTS + answer(b"final")]) as backend, \
            pool_for(backend) as (upstream, endpoint):
        with pytest.raises(RuntimeError, match="client gone"):
            await call(upstream, endpoint, on_informational=refuse)
        assert endpoint.in_flight == 0 and endpoint.open == 0 and not endpoint.idle


@pytest.mark.parametrize("method, path, body", ROUTES, ids=ROUTE_IDS)
async def test_end_to_end_early_hints_leave_the_answer_and_the_pool_intact(method, path, body):
    async with hostile([EARLY_HINTS + answer(b'{"ok": 1}')]) as backend, \
            running_proxy(config_for(decode=backend.url)) as proxy:
        for _ in range(2):
            reply = await proxy.request(method, path, body)
            assert reply.status == 200 and reply.complete and reply.body == b'{"ok": 1}'
    assert backend.connections == 1


async def test_end_to_end_a_prefill_overrun_never_answers_the_next_prefill_leg():
    prefill_answer = b'{"kv_transfer_params": {"remote_block_ids": [[1]], "n": %d}}'
    async with hostile([answer(prefill_answer % 1) + answer(prefill_answer % 666)],
                       [answer(prefill_answer % 2)]) as prefill, \
            hostile([answer(b'{"ok": 1}')]) as decode, \
            running_proxy(config_for(prefill=prefill.url, decode=decode.url)) as proxy:
        for _ in range(2):
            reply = await proxy.request("POST", "/v1/chat/completions", chat())
            assert reply.status == 200 and reply.body == b'{"ok": 1}'
    assert prefill.connections == 2  # the overrun retired the first prefill connection
    assert decode.connections == 1
    # Each decode leg carried its own prefill's answer, never the forged one.
    sent = [json.loads(body)["kv_transfer_params"]["n"] for body in decode.bodies]
    assert sent == [1, 2]


@pytest.mark.parametrize("path, body", [("/v1/models", None),
                                        ("/v1/chat/completions", {"messages": []})])
async def test_early_hints_reach_an_http11_client_before_the_answer(path, body):
    """RFC 9110 15.2: a proxy forwards the 1xx responses it did not ask for."""
    method = "GET" if body is None else "POST"
    async with hostile([EARLY_HINTS + answer(b'{"ok": 1}')]) as backend, \
            running_proxy(config_for(decode=backend.url)) as proxy:
        payload = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(payload)}\r\n\r\n").encode()
        raw = await raw_exchange(proxy.port, head + payload, half_close=True)
        early, final = raw.split(b"\r\n\r\n", 1)
        assert early.startswith(b"HTTP/1.1 103 ")
        assert b"link: </a.css>; rel=preload" in early.lower()
        assert final.startswith(b"HTTP/1.1 200 ") and final.endswith(b'{"ok": 1}')


async def test_early_hints_never_reach_an_http10_client():
    async with hostile([EARLY_HINTS + answer(b'{"ok": 1}')]) as backend, \
            running_proxy(config_for(decode=backend.url)) as proxy:
        raw = await raw_exchange(proxy.port, b"GET /v1/models HTTP/1.0\r\nhost: x\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 200 ") and b" 103 " not in raw


async def test_an_answer_of_thousands_of_tiny_chunks_is_a_protocol_error():
    """A health or bootstrap answer of 2-byte chunks kept the loop decoding for
    seconds each round: read() bounds pieces as well as bytes."""
    tiny = chunked_answer(*([b"ab"] * 5000))
    async with hostile([tiny]) as backend, pool_for(backend) as (upstream, endpoint):
        with pytest.raises(UpstreamProtocolError, match="chunks"):
            await call(upstream, endpoint, b"GET")
    few = chunked_answer(*([b"ab" * 100] * 50))
    async with hostile([few]) as backend, pool_for(backend) as (upstream, endpoint):
        _, data = await call(upstream, endpoint, b"GET")
        assert data == b"ab" * 5000  # the same bytes in fewer pieces
