"""Upstream connection pools: reuse, retirement by count, age and CA rotation, keep-alive off.

Each backend here counts the TCP connections it accepted, which is what the
pool saves (or, for retirement, deliberately spends).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from typing import AsyncIterator

import trustme

from helpers import CHAT, chat, config_for, running_proxy, wait_until
from lowproxy.config import load_config
from lowproxy.demo import DemoBackend
from lowproxy.downstream import HttpServer


class Accepted:
    """Connections a backend accepted, over its life."""

    def __init__(self) -> None:
        self.count = 0
        self.open = 0

    def __call__(self, delta: int) -> None:
        self.open += delta
        if delta > 0:
            self.count += delta


@contextlib.asynccontextmanager
async def counted_decode(ssl_context: ssl.SSLContext | None = None, **kw
                         ) -> AsyncIterator[tuple[DemoBackend, Accepted]]:
    """A demo decode backend whose server counts the connections it accepts."""
    backend = DemoBackend("decode", **kw)
    accepted = Accepted()
    backend.server = HttpServer(backend.handle, on_connections=accepted)
    await backend.server.listen("127.0.0.1", 0, ssl=ssl_context)
    backend.port = backend.server.ports[0]
    try:
        yield backend, accepted
    finally:
        await backend.close()


def env_config(decode_url: str, **env: str):
    """A Config built from PD_PROXY_* variables, as the daemon builds it."""
    # No health checks: their connections would be counted with the requests'.
    environ = {"PD_PROXY_DECODE_URL": decode_url, "PD_PROXY_HEALTH_INTERVAL_SECONDS": "0"}
    environ.update(env)
    config, _ = load_config([], environ)
    return config


async def ok(proxy, body=None) -> None:
    reply = await proxy.request("POST", CHAT, body or chat())
    assert reply.status == 200, reply.body
    assert reply.complete


async def test_one_upstream_connection_serves_sequential_requests():
    async with counted_decode() as (decode, accepted):
        async with running_proxy(config_for((), decode.url)) as proxy:
            for _ in range(5):
                await ok(proxy)
            [endpoint] = proxy.proxy.decode.endpoints
            assert accepted.count == 1
            assert endpoint.open == 1 and len(endpoint.idle) == 1
            assert len(decode.requests_to("/chat/completions")) == 5


async def test_concurrent_requests_open_one_connection_each_then_reuse_them():
    async with counted_decode() as (decode, accepted):
        decode.faults.delay = 0.05  # keep all three in flight together
        async with running_proxy(config_for((), decode.url)) as proxy:
            await asyncio.gather(*(ok(proxy) for _ in range(3)))
            assert accepted.count == 3
            await asyncio.gather(*(ok(proxy) for _ in range(3)))
            assert accepted.count == 3  # the three pooled connections served again


async def test_connection_retires_after_max_requests():
    async with counted_decode() as (decode, accepted):
        config = env_config(decode.url, PD_PROXY_UPSTREAM_MAX_REQUESTS="2")
        assert config.upstream_max_requests == 2
        async with running_proxy(config) as proxy:
            for _ in range(5):
                await ok(proxy)
            assert accepted.count == 3  # 2 + 2 + 1 requests
            await wait_until(lambda: accepted.open == 1, what="retired connections closed")


async def test_connection_retires_after_max_age():
    async with counted_decode() as (decode, accepted):
        config = env_config(decode.url, PD_PROXY_UPSTREAM_MAX_AGE_SECONDS="0.3")
        assert config.upstream_max_age == 0.3
        async with running_proxy(config) as proxy:
            await ok(proxy)
            await ok(proxy)
            assert accepted.count == 1  # young: reused
            [endpoint] = proxy.proxy.decode.endpoints
            # Past its age, the idle connection is closed (by the periodic sweep or
            # at the next checkout) and the next request gets a new one.
            await asyncio.sleep(0.4)
            await ok(proxy)
            assert accepted.count == 2
            # The sweep closes an aged idle connection even with no traffic.
            await wait_until(lambda: endpoint.open == 0 and accepted.open == 0, timeout=5.0,
                             what="aged idle connection swept")


async def test_keepalive_off_opens_one_connection_per_call():
    async with counted_decode() as (decode, accepted):
        config = env_config(decode.url, PD_PROXY_UPSTREAM_KEEPALIVE="0")
        assert config.upstream_keepalive is False
        async with running_proxy(config) as proxy:
            for _ in range(3):
                await ok(proxy)
            assert accepted.count == 3
            [endpoint] = proxy.proxy.decode.endpoints
            assert not endpoint.idle
            await wait_until(lambda: endpoint.open == 0 and accepted.open == 0,
                             what="each connection closed after its call")


async def test_response_read_partly_is_not_reused():
    async with counted_decode(stream_chunks=200, chunk_delay=0.02) as (decode, accepted):
        async with running_proxy(config_for((), decode.url)) as proxy:
            await ok(proxy)  # one pooled connection, idle
            assert accepted.count == 1
            # A streaming client that leaves after the first chunk: the pooled
            # connection carries that stream and is cut mid-body.
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            body = b'{"model":"demo-model","stream":true,' \
                   b'"messages":[{"role":"user","content":"hi"}]}'
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            received = b""
            while b"data: " not in received:
                chunk = await asyncio.wait_for(reader.read(65536), 10)
                assert chunk, "the stream ended before its first chunk"
                received += chunk
            assert received.startswith(b"HTTP/1.1 200")
            writer.transport.abort()
            await wait_until(lambda: decode.aborted_streams == 1, timeout=5.0,
                             what="decode saw its stream aborted")
            [endpoint] = proxy.proxy.decode.endpoints
            await wait_until(lambda: endpoint.open == 0 and not endpoint.idle,
                             what="the cut connection closed, not pooled")
            await ok(proxy)
            assert accepted.count == 2  # the next request needed a new connection
            assert decode.open_streams == 0


async def test_ca_rotation_retires_pooled_connections(tmp_path):
    old_ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    old_ca.issue_cert("127.0.0.1").configure_cert(server_context)
    ca_file = tmp_path / "ca.pem"
    old_ca.cert_pem.write_to_path(str(ca_file))
    async with counted_decode(ssl_context=server_context) as (decode, accepted):
        url = f"https://127.0.0.1:{decode.port}"
        async with running_proxy(config_for((), url, ca_file=str(ca_file))) as proxy:
            await ok(proxy)
            await ok(proxy)
            assert accepted.count == 1  # pooled under the first trust
            # Rotate as Kubernetes does: a new file swapped in place (new inode).
            # It still trusts the backend's issuer, so only the rotation retires.
            new_ca = trustme.CA()
            rotated = tmp_path / "ca.pem.new"
            rotated.write_bytes(new_ca.cert_pem.bytes() + old_ca.cert_pem.bytes())
            os.replace(rotated, ca_file)
            await ok(proxy)
            assert accepted.count == 2
            await ok(proxy)
            assert accepted.count == 2  # the connection made under the new trust pools
            await wait_until(lambda: accepted.open == 1, what="old-trust connection closed")
