"""Every client-side limit over a raw socket, and a normal request served right after.

Limits are set small here (the defaults are checked once, against config/settings.py);
each test opens its own proxy in front of demo backends, sends what a hostile
or broken client would, checks the status and that the connection was closed,
that no backend saw the request, and that the proxy still serves a normal
request afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import resource
import signal
import socket

import pytest

from helpers import (
    CHAT,
    Daemon,
    ScriptedBackend,
    chat,
    config_for,
    free_port,
    parse_replies,
    pd_setup,
    raw_exchange,
    request,
    running_proxy,
    wait_until,
)
from lowproxy.config import Config, load_config
from lowproxy.demo import DemoBackend
from lowproxy.upstream.stream import READ_HIGH_WATER, _StreamProtocol

LIMITS = dict(max_header_bytes=4096, max_body_bytes=4096)


async def assert_serves(proxy) -> None:
    """The proxy still answers a normal streamed generation, completely."""
    reply = await proxy.request("POST", CHAT, chat(stream=True))
    assert reply.status == 200 and reply.complete, reply
    assert reply.body.endswith(b"data: [DONE]\n\n")


def only(raw: bytes):
    replies = parse_replies(raw)
    assert len(replies) == 1, replies
    reply = replies[0]
    assert reply.complete, raw
    return reply


def post_head(length: int | None = None, extra: bytes = b"", target: bytes = CHAT.encode()
              ) -> bytes:
    head = b"POST " + target + b" HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    if length is not None:
        head += b"content-length: %d\r\n" % length
    return head + extra + b"\r\n"


def test_defaults_are_the_documented_ones():
    config, _ = load_config([], {})
    assert config.max_header_bytes == 64 * 1024 == Config().max_header_bytes
    assert config.max_body_bytes == 32 * 1024 * 1024
    assert config.header_timeout == 30.0 and config.keepalive_timeout == 75.0
    assert config.max_connections == 10000 and config.drain_seconds == 25.0
    assert config.decode_timeout is None  # no bound on a started generation by default
    env = {"PD_PROXY_MAX_HEADER_BYTES": "2048", "PD_PROXY_MAX_BODY_BYTES": "10",
           "PD_PROXY_HEADER_TIMEOUT_SECONDS": "1.5", "PD_PROXY_KEEPALIVE_SECONDS": "2",
           "PD_PROXY_MAX_CONNECTIONS": "7", "PD_PROXY_DECODE_TIMEOUT_SECONDS": "9"}
    config, _ = load_config([], env)
    assert (config.max_header_bytes, config.max_body_bytes, config.header_timeout,
            config.keepalive_timeout, config.max_connections, config.decode_timeout) == (
        2048, 10, 1.5, 2.0, 7, 9.0)
    config, _ = load_config(["--max-header-bytes", "3000", "--max-connections", "3"], env)
    assert config.max_header_bytes == 3000 and config.max_connections == 3


# -- head size


async def test_head_over_the_limit_in_one_piece_is_431_and_closed():
    async with pd_setup(**LIMITS) as (proxy, prefill, decode):
        body = b'{"model":"m","prompt":"x"}'
        padding = b"x-pad: " + b"a" * 5000 + b"\r\n"
        reply = only(await raw_exchange(proxy.port, post_head(len(body), padding) + body))
        assert reply.status == 431
        assert reply.header("connection") == b"close"
        assert reply.json()["error"]["code"] == 431
        assert not decode.received and not prefill.received
        await assert_serves(proxy)


async def test_head_that_never_ends_is_431_once_past_the_limit():
    async with pd_setup(**LIMITS) as (proxy, prefill, decode):
        # Many small header lines and no blank line: the head is still incomplete.
        endless = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"x-a: b\r\n" * 2000
        reply = only(await raw_exchange(proxy.port, endless))
        assert reply.status == 431
        assert not decode.received
        await assert_serves(proxy)


async def test_head_just_under_the_limit_is_served():
    async with pd_setup(**LIMITS) as (proxy, prefill, decode):
        reply = await proxy.request("GET", "/v1/models", headers=[("x-pad", "a" * 3500)])
        assert reply.status == 200
        assert decode.received[-1].path == "/v1/models"


# -- body size


async def test_declared_body_over_the_limit_is_413_before_the_body_is_sent():
    async with pd_setup(**LIMITS) as (proxy, prefill, decode):
        # Only the head is sent: the answer must not wait for the body.
        reply = only(await raw_exchange(proxy.port, post_head(10 * 1024 * 1024)))
        assert reply.status == 413
        assert reply.header("connection") == b"close"
        assert not decode.received and not prefill.received
        await assert_serves(proxy)


async def test_chunked_body_over_the_limit_is_413_and_the_rest_is_not_read():
    async with pd_setup(**LIMITS) as (proxy, prefill, decode):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(post_head(extra=b"transfer-encoding: chunked\r\n"))
        chunk = b"%x\r\n%s\r\n" % (1000, b"a" * 1000)
        for _ in range(5):  # 5000 bytes > 4096; the terminator never comes
            writer.write(chunk)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)  # to EOF: the proxy closed
        writer.close()
        reply = only(raw)
        assert reply.status == 413
        assert not decode.received and not prefill.received
        await assert_serves(proxy)


async def test_body_at_the_limit_is_served():
    async with pd_setup(**LIMITS) as (proxy, prefill, decode):
        body = chat(messages=[{"role": "user", "content": "a" * 3800}])
        reply = await proxy.request("POST", CHAT, body)
        assert reply.status == 200, reply.body
        assert decode.requests_to(CHAT)[0].body["messages"] == body["messages"]


# -- timeouts


async def test_head_not_complete_in_time_is_408_and_closed():
    async with pd_setup(header_timeout=0.3) as (proxy, prefill, decode):
        # A slowloris: a byte now and then never completes the head in time.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    writer.write(b"x-a: b\r\n")
                    await writer.drain()

        trickling = asyncio.create_task(trickle())
        raw = await asyncio.wait_for(reader.read(), 5)
        trickling.cancel()
        writer.close()
        reply = only(raw)
        assert reply.status == 408
        assert not decode.received
        await assert_serves(proxy)


async def test_silent_connection_is_closed_after_the_header_timeout():
    async with pd_setup(header_timeout=0.3) as (proxy, prefill, decode):
        raw = await raw_exchange(proxy.port, b"", timeout=5)
        assert raw == b"" or only(raw).status == 408
        await assert_serves(proxy)


async def test_body_that_stops_arriving_is_408():
    async with pd_setup(header_timeout=0.3) as (proxy, prefill, decode):
        raw = await raw_exchange(proxy.port, post_head(100) + b'{"model":', timeout=5)
        assert only(raw).status == 408
        assert not decode.received
        await assert_serves(proxy)


async def test_body_trickling_a_byte_at_a_time_is_408_on_its_whole_deadline():
    """Each read re-armed the head timeout: a byte every 29 s held a slot for ever.
    The whole body gets the head timeout plus a second per 16 KiB that came."""
    async with pd_setup(header_timeout=0.3) as (proxy, prefill, decode):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(post_head(1000) + b'{"model":')

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(100):  # 0.15 s apart: each within the head timeout
                    await asyncio.sleep(0.15)
                    writer.write(b" ")
                    await writer.drain()

        trickling = asyncio.create_task(trickle())
        raw = await asyncio.wait_for(reader.read(), 5)
        trickling.cancel()
        writer.close()
        assert only(raw).status == 408
        assert not decode.received
        await assert_serves(proxy)


async def test_idle_keep_alive_connection_is_closed_quietly():
    async with pd_setup(keepalive_timeout=0.3, header_timeout=5) as (proxy, prefill, decode):
        request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        raw = await raw_exchange(proxy.port, request, timeout=5)
        # One answer, then a close with no 408: the client asked for nothing more.
        [reply] = parse_replies(raw)
        assert reply.status == 200 and reply.complete
        assert b"408" not in raw
        await assert_serves(proxy)


async def test_keep_alive_connection_serves_several_requests():
    async with pd_setup(keepalive_timeout=5) as (proxy, prefill, decode):
        request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        last = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nconnection: close\r\n\r\n"
        raw = await raw_exchange(proxy.port, request * 3 + last)
        assert [r.status for r in parse_replies(raw)] == [200] * 4


# -- connection count


async def test_connections_past_the_limit_get_503_and_are_closed():
    async with pd_setup(max_connections=3) as (proxy, prefill, decode):
        held = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            held.append((reader, writer))
        await wait_until(lambda: len(proxy.server.connections) == 3, what="3 accepted")
        raw = await raw_exchange(proxy.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = only(raw)
        assert reply.status == 503 and reply.header("connection") == b"close"
        assert reply.json()["error"]["message"] == "too many connections"
        assert not decode.received
        # The held connections are served as usual.
        reader, writer = held[0]
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        # Freeing one slot lets a new client in.
        for _, writer in held:
            writer.close()
        await wait_until(lambda: not proxy.server.connections, what="held connections closed")
        await assert_serves(proxy)


# -- malformed requests: 400 (505 for a version), close, never a backend

MALFORMED = {
    "bad request line": b"GET\r\nHost: x\r\n\r\n",
    "http/0.9": b"GET /v1/models\r\n\r\n",
    "space in header name": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nbad name: y\r\n\r\n",
    "space before colon": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-a : y\r\n\r\n",
    "bare cr": b"GET /v1/models HTTP/1.1\r\nHost: x\rx-a: y\r\n\r\n",
    "no host": b"GET /v1/models HTTP/1.1\r\n\r\n",
    "nul in value": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-a: a\x00b\r\n\r\n",
    "cl with te": post_head(4, b"transfer-encoding: chunked\r\n") + b"0\r\n\r\n",
    "negative cl": post_head(extra=b"content-length: -4\r\n") + b"abcd",
    "signed cl": post_head(extra=b"content-length: +4\r\n") + b"abcd",
    "hex cl": post_head(extra=b"content-length: 0x4\r\n") + b"abcd",
    "conflicting cl": post_head(4, b"content-length: 5\r\n") + b"abcde",
    "duplicate cl": post_head(4, b"content-length: 4\r\n") + b"abcd",
    "cl list": post_head(extra=b"content-length: 4, 4\r\n") + b"abcd",
    "unknown te": post_head(extra=b"transfer-encoding: gzip\r\n") + b"abcd",
    "te list": post_head(extra=b"transfer-encoding: gzip, chunked\r\n") + b"0\r\n\r\n",
    "duplicate te": post_head(extra=b"transfer-encoding: chunked\r\n"
                              b"transfer-encoding: chunked\r\n") + b"0\r\n\r\n",
    "te in http/1.0": (b"POST /v1/completions HTTP/1.0\r\nHost: x\r\n"
                       b"transfer-encoding: chunked\r\n\r\n4\r\nabcd\r\n0\r\n\r\n"),
    "obs-fold": post_head(4, b"x-a: b\r\n c\r\n") + b"abcd",
    "bad chunk size": post_head(extra=b"transfer-encoding: chunked\r\n") + b"zz\r\nab\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_request_is_400_closed_and_never_forwarded(case):
    async with pd_setup() as (proxy, prefill, decode):
        raw = await raw_exchange(proxy.port, MALFORMED[case])
        reply = only(raw)
        assert reply.status == 400, (case, raw)
        assert reply.header("connection") == b"close"
        assert reply.json()["error"]["type"] == "bad_request"
        assert not decode.received and not prefill.received
        await assert_serves(proxy)


@pytest.mark.parametrize("version", [b"2.0", b"1.2", b"3.0"])
async def test_unknown_http_version_is_505(version):
    async with pd_setup() as (proxy, prefill, decode):
        raw = await raw_exchange(proxy.port, b"GET /v1/models HTTP/%s\r\nHost: x\r\n\r\n"
                                 % version)
        assert only(raw).status == 505
        assert not decode.received
        await assert_serves(proxy)


@pytest.mark.parametrize("method", [b"PUT", b"DELETE", b"PATCH", b"TRACE", b"CONNECT", b"FOO"])
async def test_other_methods_are_405_with_allow(method):
    async with pd_setup() as (proxy, prefill, decode):
        target = b"127.0.0.1:1" if method == b"CONNECT" else b"/v1/models"
        raw = await raw_exchange(proxy.port, method + b" " + target
                                 + b" HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n")
        reply = only(raw)
        assert reply.status == 405
        allowed = {m.strip() for m in reply.header("allow").split(b",")}
        assert allowed == {b"GET", b"POST", b"HEAD", b"OPTIONS"}
        assert not decode.received
        await assert_serves(proxy)


async def test_allowed_methods_are_forwarded():
    async with pd_setup() as (proxy, prefill, decode):
        for method in ("GET", "HEAD", "OPTIONS"):
            reply = await proxy.request(method, "/v1/models")
            assert reply.status < 500, (method, reply)
        assert [r.method for r in decode.received] == ["GET", "HEAD", "OPTIONS"]


# -- a client that reads slower than decode writes


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


async def test_a_client_that_stops_reading_pushes_back_on_decode():
    """Decode streams as fast as it can; the client reads nothing. The proxy must stop
    reading decode (bounded buffers), not hold the stream in memory."""
    total = 256 * 1024 * 1024
    piece = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
    sent = 0

    async def flood(request, responder):
        nonlocal sent
        await responder.start(200, [(b"content-type", b"text/event-stream")])
        while sent < total:
            await responder.write(piece)  # awaits drain: blocks when the proxy stops reading
            sent += len(piece)
        await responder.end()

    decode = await ScriptedBackend(flood).start()
    try:
        async with running_proxy(config_for((), decode.url())) as proxy:
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            client.setblocking(False)
            await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", proxy.port))
            rss_before = _rss_bytes()
            body = b'{"model":"m","prompt":"x","stream":true}'
            client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\n"
                        b"content-type: application/json\r\n\r\n%s" % (len(body), body))
            # Wait until decode is blocked: `sent` stops growing (for 0.3 s).
            samples = [-1]
            for _ in range(300):
                await asyncio.sleep(0.05)
                samples.append(sent)
                if sent > 0 and samples[-6:] == [sent] * 6:
                    break
            assert 0 < sent < 64 * 1024 * 1024, sent  # stuck far short of the 256 MiB
            [connection] = proxy.server.connections
            buffered = connection.transport.get_write_buffer_size()
            assert buffered <= 1024 * 1024, buffered
            # What the proxy holds of decode's stream, unread, is bounded too: the
            # upstream stream stopped reading its socket.
            [upstream] = [obj for obj in gc.get_objects()
                          if isinstance(obj, _StreamProtocol) and obj.transport is not None
                          and not obj.transport.is_closing()]
            # (past the high-water mark by at most one event-loop read of 256 KiB)
            assert upstream.reading_paused, upstream.size
            assert upstream.size <= READ_HIGH_WATER + 256 * 1024, upstream.size
            assert _rss_bytes() - rss_before < 48 * 1024 * 1024
            # The client reads again: the stream resumes and completes.
            received = 0
            loop = asyncio.get_running_loop()
            while True:
                data = await asyncio.wait_for(loop.sock_recv(client, 1024 * 1024), 10)
                if not data:
                    break
                received += len(data)
                if data.endswith(b"0\r\n\r\n") and sent >= total:
                    break
            client.close()
            assert sent == total and received > total
    finally:
        await decode.close()


async def test_a_client_that_takes_nothing_for_the_write_timeout_is_gone():
    """Back-pressure held a client that stopped reading (not closing) with its decode
    leg, and the decode slot, for ever: after PD_PROXY_CLIENT_WRITE_TIMEOUT_SECONDS
    without draining a byte of a full buffer it is taken as gone, decode is closed."""
    piece = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
    closed = asyncio.Event()

    async def flood(request, responder):
        await responder.start(200, [(b"content-type", b"text/event-stream")])
        try:
            while True:
                await responder.write(piece)
        finally:
            closed.set()  # the proxy closed the decode leg

    decode = await ScriptedBackend(flood).start()
    try:
        config = config_for((), decode.url(), client_write_timeout=1.0)
        async with running_proxy(config) as proxy:
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            client.setblocking(False)
            await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", proxy.port))
            body = b'{"model":"m","prompt":"x","stream":true}'
            client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\n"
                        b"content-type: application/json\r\n\r\n%s" % (len(body), body))
            try:
                await asyncio.wait_for(closed.wait(), 10)
                await wait_until(lambda: not proxy.server.connections, 5, "client dropped")
                endpoint = proxy.proxy.decode.endpoints[0]
                assert endpoint.in_flight == 0
            finally:
                client.close()
    finally:
        await decode.close()



class _SlowWire:
    """What _drain_bounded reads of a connection: a buffer taken ``taken`` bytes at
    each of its waits, a drain that ends once it is empty."""

    def __init__(self, size: int, taken: int) -> None:
        self.size, self.taken, self.dropped = size, taken, False
        self.transport = self
        self.writer = self

    def get_write_buffer_size(self) -> int:
        return self.size

    async def drain(self) -> None:
        while self.size > 0:
            await asyncio.sleep(0.05)
            self.size = max(0, self.size - self.taken)
            if not self.taken:
                await asyncio.sleep(3600)

    def drop(self) -> None:
        self.dropped = True


async def test_the_write_timeout_bounds_a_client_taking_nothing_not_a_slow_drain():
    """nginx's send_timeout: between two bytes taken, not for the whole drain. A drain
    of 2 s at a steady trickle outlasts a 0.2 s bound; a buffer nothing is taken of
    for the bound is the client gone (the review found the whole drain bounded)."""
    from lowproxy.downstream.connection import ClientConnection
    from lowproxy.downstream.messages import ClientGone

    steady = _SlowWire(size=40 * 1024, taken=1024)  # 40 waits of 0.05 s: 2 s in all
    await ClientConnection._drain_bounded(steady, 0.2)  # type: ignore[arg-type]
    assert steady.size == 0 and not steady.dropped
    stalled = _SlowWire(size=40 * 1024, taken=0)
    with pytest.raises(ClientGone):
        await ClientConnection._drain_bounded(stalled, 0.2)  # type: ignore[arg-type]
    assert stalled.dropped


async def test_a_client_reading_slowly_but_steadily_outlasts_the_write_timeout():
    """The bound is on a client taking nothing (nginx's send_timeout), not on the whole
    drain: one reading 4 KiB every 0.1 s through a drain that takes seconds stays."""
    piece = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"

    async def flood(request, responder):
        await responder.start(200, [(b"content-type", b"text/event-stream")])
        for _ in range(12):
            await responder.write(piece)
        await responder.end()

    decode = await ScriptedBackend(flood).start()
    try:
        config = config_for((), decode.url(), client_write_timeout=0.5)
        async with running_proxy(config) as proxy:
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(client, ("127.0.0.1", proxy.port))
            body = b'{"model":"m","prompt":"x","stream":true}'
            client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\n"
                        b"content-type: application/json\r\n\r\n%s" % (len(body), body))
            received = b""
            try:
                while not received.endswith(b"0\r\n\r\n"):
                    data = await asyncio.wait_for(loop.sock_recv(client, 4096), 10)
                    assert data, "the proxy dropped a client that was reading"
                    received += data
                    await asyncio.sleep(0.1 if len(received) < 256 * 1024 else 0)
            finally:
                client.close()
            assert received.count(b"data: ") == 12
    finally:
        await decode.close()


async def test_idle_sockets_on_the_probe_port_do_not_fail_the_probes():
    """The kubelet probes the metrics port: 64 idle sockets held every slot for the
    main port's 30 s head timeout, and liveness answered 503 until the pod restarted."""
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    metrics_port = free_port()
    daemon = Daemon([], {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0",
                         "PD_PROXY_LOOP": "asyncio", "PD_PROXY_DECODE_URL": decode.url,
                         "PD_PROXY_METRICS_PORT": str(metrics_port)})
    idle = []
    try:
        await asyncio.to_thread(daemon.wait_listening)
        for _ in range(100):  # more than the old cap of 64; they send nothing
            idle.append(await asyncio.open_connection("127.0.0.1", metrics_port))
        await asyncio.sleep(3.0)  # past the probe port's 2 s head timeout
        assert (await request(metrics_port, "GET", "/healthz")).status == 200
        assert (await request(metrics_port, "GET", "/readyz")).status == 200
        closed = 0
        for reader, _ in idle:  # each was answered 408 and closed
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(), 1.0)
                closed += reader.at_eof()
        assert closed == len(idle)
    finally:
        for _, writer in idle:
            writer.close()
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0, daemon.output()
        await decode.close()
