"""Issue 19, defect 4: PD_PROXY_MAX_CONNECTIONS counts a TLS connection from its accept on.

Stalled handshakes (a TCP connection that never sends its ClientHello) beyond the
cap are closed at once, those within it are closed by the handshake's own bound
(PD_PROXY_TLS_HANDSHAKE_TIMEOUT_SECONDS, here far shorter than the header
timeout), and a normal client is served once slots are free. In process (the
HttpServer on asyncio) and in the daemon on each event loop, where the daemon's
open file descriptors show the cap holding.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
from typing import Any

import pytest
import trustme
from test_client_tls import client_context, https_get, write_pair

from helpers import Daemon, wait_until
from lowproxy.downstream.server import HttpServer, Limits


async def answer_ok(request: Any, responder: Any) -> None:
    await responder.send_json(200, {"ok": True})


async def stall(port: int, count: int) -> list[tuple[asyncio.StreamReader, Any]]:
    """``count`` TCP connections that never start their TLS handshake."""
    opened = []
    for _ in range(count):
        opened.append(await asyncio.open_connection("127.0.0.1", port))
    return opened


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read(1) == b""
    except ConnectionError:
        return True


async def wait_closed_by_server(stalled: list[Any], timeout: float) -> None:
    await asyncio.wait_for(asyncio.gather(*(closed_by_server(r) for r, _ in stalled)), timeout)


def close_all(stalled: list[Any]) -> None:
    for _, writer in stalled:
        writer.close()


async def test_stalled_handshakes_beyond_the_cap_are_closed_and_the_cap_holds():
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)
    server = HttpServer(answer_ok, Limits(max_connections=5, header_timeout=120.0,
                                          tls_handshake_timeout=3.0))
    await server.listen("127.0.0.1", 0, ssl=context)
    port = server.ports[0]
    stalled = await stall(port, 20)
    try:
        # The 15 beyond the cap are closed at once; 5 handshakes are held.
        states = await asyncio.gather(*(asyncio.wait_for(closed_by_server(r), 0.5)
                                        for r, _ in stalled), return_exceptions=True)
        refused = [s for s in states if s is True]
        assert len(refused) >= 15 - 1  # a reader may time out of its 0.5 s on a busy machine
        await wait_until(lambda: server.handshaking == 5, 10, "five handshakes held")
        assert server.handshaking + len(server.connections) == 5
        # A real client while the slots are full: closed before any TLS.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await https_get(port, client_context(ca))
        assert server.handshaking == 5
        # The handshake bound, not the header timeout (120 s), frees the slots.
        await wait_closed_by_server(stalled, 30)
        await wait_until(lambda: server.handshaking == 0, 10, "slots free")
        status, body, _ = await https_get(port, client_context(ca), "/")
        assert status == 200 and body == b'{"ok":true}'
    finally:
        close_all(stalled)
        await server.drain(0)
    assert server.handshaking == 0 and not server.connections


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_the_daemon_holds_its_cap_on_stalled_tls_handshakes(tmp_path, loop):
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is optional (lowproxy[fast])")
    ca = trustme.CA()
    cert_file, key_file = write_pair(tmp_path, ca.issue_cert("localhost"))
    daemon = Daemon([], {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0",
                         "PD_PROXY_LOOP": loop, "PD_PROXY_TLS_CERT_FILE": cert_file,
                         "PD_PROXY_TLS_KEY_FILE": key_file, "PD_PROXY_MAX_CONNECTIONS": "20",
                         "PD_PROXY_TLS_HANDSHAKE_TIMEOUT_SECONDS": "3",
                         "PD_PROXY_HEADER_TIMEOUT_SECONDS": "120"})
    stalled: list[Any] = []
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        status, _, _ = await https_get(port, client_context(ca), "/healthz")
        assert status == 200
        before = open_fds(daemon.proc.pid)
        stalled = await stall(port, 300)
        states = await asyncio.gather(*(asyncio.wait_for(closed_by_server(r), 2.0)
                                        for r, _ in stalled), return_exceptions=True)
        assert sum(1 for s in states if s is True) >= 280 - 5
        # The daemon holds at most the cap's sockets for them (and a few of its own).
        assert open_fds(daemon.proc.pid) - before <= 20 + 3
        await wait_closed_by_server(stalled, 30)  # each by the 3 s handshake bound
        status, body, _ = await https_get(port, client_context(ca), "/healthz")
        assert status == 200
    finally:
        close_all(stalled)
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0, daemon.output()
