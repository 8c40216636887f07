"""Every socket on a request's path has TCP_NODELAY, under both event loops.

A stream is many small writes to the client; with Nagle's algorithm on, the
second would wait for the ACK of the first, which a delayed-ACK peer holds for
up to 40 ms. asyncio and uvloop both set TCP_NODELAY on the TCP transports
they make (accepted and dialled); lowproxy relies on that rather than setting
it again, so this pins it for the client's socket and both legs' connections.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from helpers import Client, config_for, pd_backends, running_proxy

CHAT = "/v1/chat/completions"
BODY = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2}


def nodelay(sock: object) -> bool:
    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))  # type: ignore


async def sockets_on_the_path() -> list[tuple[str, bool]]:
    """(which socket, its TCP_NODELAY) once a relayed request was answered."""
    async with pd_backends(prefills=1, decodes=1) as (pre, dec):
        config = config_for([b.url for b in pre], [b.url for b in dec])
        async with running_proxy(config) as running:
            client = await Client.open(running.port)
            try:
                client.send("POST", CHAT, BODY)
                reply = await client.reply()
                assert reply.status == 200
                seen = [("client", nodelay(c.transport.get_extra_info("socket")))
                        for c in running.server.connections]
                for role, group in (("prefill", running.proxy.prefill),
                                    ("decode", running.proxy.decode)):
                    for endpoint in group.endpoints:
                        seen += [(role, nodelay(p.stream.get_extra_info("socket")))
                                 for p in endpoint.idle]
            finally:
                client.close()
    return seen


def check(seen: list[tuple[str, bool]]) -> None:
    assert sorted(role for role, _ in seen) == ["client", "decode", "prefill"]
    assert all(on for _, on in seen), seen


async def test_nodelay_on_every_socket_under_asyncio():
    check(await sockets_on_the_path())


def test_nodelay_on_every_socket_under_uvloop():
    uvloop = pytest.importorskip("uvloop", reason="uvloop is optional (lowproxy[fast])")
    loop = uvloop.new_event_loop()
    try:
        check(loop.run_until_complete(sockets_on_the_path()))
    finally:
        loop.close()
    asyncio.set_event_loop(None)
