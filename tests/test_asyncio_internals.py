"""asyncio_internals: a closed selector transport freed by reference counting.

CPython's selector transport holds its read callback as a bound method of
itself; lowproxy clears it once the transport is closing, on both sides, so a
closed connection (and, upstream, its pooled connection, h11 state and
buffers) does not wait for the cyclic GC. The cyclic GC is off while these
run: what is asserted is what reference counting alone frees.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import sys
import weakref
from typing import Any, Iterator

import pytest

from helpers import CHAT, chat, config_for, running_proxy
from helpers.client import Client
from lowproxy.asyncio_internals import (
    TRANSPORT_READ_SIZE,
    read_in_heap_sized_pieces,
    release_closed_transport,
    slim_drain_waiters,
)
from lowproxy.demo import DemoBackend
from lowproxy.upstream.endpoint import PooledConnection


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def selector_loop_only() -> None:
    if not isinstance(asyncio.get_running_loop(), asyncio.selector_events.BaseSelectorEventLoop):
        pytest.skip("the selector transport is asyncio's own loop's")


async def _connected_pair() -> tuple[asyncio.Transport, asyncio.AbstractServer]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    return transport, server


async def _lost(transport: asyncio.Transport) -> None:
    for _ in range(3):  # connection_lost runs a loop iteration after close
        await asyncio.sleep(0)


async def test_the_pinned_internal_a_closed_transport_keeps_itself_alive():
    """The internal asyncio_internals relies on: if this fails, CPython changed it."""
    selector_loop_only()
    transport, server = await _connected_pair()
    try:
        assert transport._read_ready_cb.__self__ is transport  # type: ignore[attr-defined]
        if sys.version_info >= (3, 12):  # and the write callback, on the instance
            assert transport.__dict__["_write_ready"].__self__ is transport
        with no_cyclic_gc():
            alive = weakref.ref(transport)
            transport.abort()  # 3.12+ clears the callback in close(), never in abort()
            await _lost(transport)
            del transport
            assert alive() is not None  # in a cycle: only the cyclic GC would free it
            gc.collect()
            assert alive() is None
    finally:
        server.close()


async def test_a_released_closed_transport_is_freed_at_once():
    selector_loop_only()
    transport, server = await _connected_pair()
    try:
        with no_cyclic_gc():
            alive = weakref.ref(transport)
            transport.abort()
            release_closed_transport(transport)
            await _lost(transport)
            del transport
            assert alive() is None
    finally:
        server.close()


async def test_an_open_transport_is_left_alone():
    selector_loop_only()
    transport, server = await _connected_pair()
    try:
        release_closed_transport(transport)
        release_closed_transport(None)
        assert transport._read_ready_cb is not None  # type: ignore[attr-defined]
        transport.write(b"still usable")
    finally:
        transport.close()
        server.close()


def _closed_transports_to(port: int, end: str) -> list[Any]:
    """Transports still alive whose ``end`` ('peername' or 'sockname') is ``port``."""
    found = []
    for obj in gc.get_objects():
        if isinstance(obj, asyncio.Transport) and obj.is_closing():
            address = obj.get_extra_info(end)
            if isinstance(address, tuple) and address[1] == port:
                found.append(obj)
    return found


async def test_connections_the_proxy_closed_are_freed_without_the_cyclic_gc():
    """Keep-alive off upstream: every request opens and discards a decode connection;
    each client connection closes after its answer. None of them outlives its close."""
    selector_loop_only()
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    try:
        config = config_for((), decode.url, upstream_keepalive=False)
        async with running_proxy(config) as proxy:
            with no_cyclic_gc():
                for _ in range(5):
                    reply = await proxy.request("POST", CHAT, chat(),
                                                headers=[("connection", "close")])
                    assert reply.status == 200
                for _ in range(5):
                    await asyncio.sleep(0)
                assert not [o for o in gc.get_objects() if isinstance(o, PooledConnection)]
                assert not _closed_transports_to(decode.port, "peername")
                assert not _closed_transports_to(proxy.port, "sockname")
    finally:
        await decode.close()


async def test_the_pinned_internal_stream_protocols_keep_drain_waiters_in_a_deque():
    protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
    assert type(protocol._drain_waiters) is collections.deque  # type: ignore[attr-defined]
    slim_drain_waiters(protocol)
    assert protocol._drain_waiters == []  # type: ignore[attr-defined]
    slim_drain_waiters(asyncio.Protocol())  # nothing to slim: left alone


async def test_drain_waits_and_wakes_with_the_list():
    """drain() on a paused connection waits, in the list, until writing resumes."""
    protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
    slim_drain_waiters(protocol)
    protocol.pause_writing()
    waiting = asyncio.ensure_future(protocol._drain_helper())  # type: ignore[attr-defined]
    await asyncio.sleep(0)
    assert len(protocol._drain_waiters) == 1 and not waiting.done()  # type: ignore[attr-defined]
    protocol.resume_writing()
    await asyncio.wait_for(waiting, 1.0)
    assert protocol._drain_waiters == []  # type: ignore[attr-defined]


async def test_client_connections_get_the_list():
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    try:
        async with running_proxy(config_for((), decode.url)) as proxy:
            client = await Client.open(proxy.port)
            try:
                client.send("POST", CHAT, chat())
                assert (await client.reply()).status == 200
                [connection] = proxy.server.connections
                protocol = connection.writer.transport.get_protocol()
                protocol = getattr(protocol, "inner", protocol)  # under the hang-up hook
                assert type(protocol._drain_waiters) is list  # type: ignore[attr-defined]
            finally:
                client.close()
    finally:
        await decode.close()


async def test_the_pinned_internal_selector_transports_read_256_kib_at_once():
    """asyncio's recv size, above glibc's mmap threshold: a map, remap and unmap per read."""
    selector_loop_only()
    transport, server = await _connected_pair()
    try:
        assert transport.max_size == 256 * 1024 > TRANSPORT_READ_SIZE  # type: ignore[attr-defined]
        read_in_heap_sized_pieces(transport)
        assert transport.max_size == TRANSPORT_READ_SIZE  # type: ignore[attr-defined]
        read_in_heap_sized_pieces(asyncio.Transport())  # none to change: left alone
    finally:
        transport.close()
        server.close()


async def test_both_sides_of_the_proxy_read_in_heap_sized_pieces_and_a_large_body_goes_whole():
    """The client's connection and the decode leg's read TRANSPORT_READ_SIZE at most; a client
    body five times that still reaches decode whole."""
    selector_loop_only()
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    try:
        async with running_proxy(config_for((), decode.url)) as proxy:
            client = await Client.open(proxy.port)
            try:
                prompt = "p" * (5 * TRANSPORT_READ_SIZE)
                client.send("POST", "/v1/completions", {"model": "demo-model", "prompt": prompt,
                                                          "max_tokens": 4, "echo": True})
                reply = await client.reply()
                assert reply.status == 200, reply.body
                [connection] = proxy.server.connections
                assert connection.writer.transport.max_size == TRANSPORT_READ_SIZE
                [endpoint] = proxy.proxy.decode.endpoints
                [pooled] = endpoint.idle
                assert pooled.stream is not None
                assert pooled.stream._transport.max_size == TRANSPORT_READ_SIZE
                [leg] = decode.requests_to("/v1/completions")
                assert leg.body["prompt"] == prompt
            finally:
                client.close()
    finally:
        await decode.close()
