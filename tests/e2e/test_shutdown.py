"""SIGTERM/SIGINT: stop accepting, answer /readyz 503, let streams finish, exit 0.

The daemon runs as a child process (``python -m lowproxy``) in front of demo
backends started in this test's event loop, so their streams can be slowed
down: a stream in flight when the signal arrives must complete, a second
signal must end the process at once, and the drain deadline must cut what is
still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from helpers import (
    CHAT,
    Client,
    Daemon,
    Reply,
    chat,
    eventually,
    exchange,
    follow_output,
    free_port,
    request,
)
from lowproxy.demo import start_pair


@contextlib.asynccontextmanager
async def daemon_in_front(chunks: int, chunk_delay: float, drain: float, **env: str):
    prefill, decode = await start_pair(stream_chunks=chunks, chunk_delay=chunk_delay)
    daemon = Daemon(["--host", "127.0.0.1", "--port", "0",
                     "--prefill", f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}",
                     "--decode", decode.url],
                    {"PD_PROXY_DRAIN_SECONDS": str(drain), "PD_PROXY_LOOP": "asyncio", **env})
    try:
        await asyncio.to_thread(daemon.wait_listening)
        output = follow_output(daemon)
        yield daemon, decode
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
        await asyncio.to_thread(daemon.proc.wait)
        await asyncio.to_thread(output.join, 5)
        daemon.output()  # collects what is left and closes the pipes
        await prefill.close()
        await decode.close()


async def stream_in_flight(port: int) -> Client:
    """A streamed generation on its own connection, once its first event has arrived."""
    client = await Client.open(port)
    client.send("POST", CHAT, chat(stream=True))
    await client.read_until(b"data: ")
    return client


async def rest_of(stream: Client, timeout: float = 30.0) -> Reply:
    """The stream read to its end: its last chunk, or the connection's end."""
    try:
        return await stream.reply(timeout, reset_ends=True)
    finally:
        stream.close()


async def keep_alive(port: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    reply = await exchange(reader, writer, "GET", "/health")
    assert reply.status == 200  # accepted, served, and kept open
    return reader, writer


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except (ConnectionRefusedError, ConnectionResetError):
        # A connect racing the listener's close is reset rather than refused.
        return True
    writer.close()
    return False


async def test_sigterm_lets_a_stream_finish_then_exits_0():
    metrics_port = free_port()
    async with daemon_in_front(40, 0.1, drain=25,
                               PD_PROXY_METRICS_PORT=str(metrics_port)) as (daemon, decode):
        port = daemon.port
        probe = await keep_alive(port)  # idle keep-alive connections, opened before
        worker = await keep_alive(port)
        stream = await stream_in_flight(port)
        daemon.proc.send_signal(signal.SIGTERM)

        # The listener closes: new clients go elsewhere.
        await eventually(lambda: refused(port), what="listener closed")
        # An idle connection is told: /readyz 503, new work 503 "shutting down".
        ready = await eventually(lambda: _readyz_when_draining(probe), what="readyz 503")
        assert ready.json()["status"] == "unavailable"
        assert ready.header("connection") == b"close"
        busy = await exchange(*worker, "POST", CHAT, chat())
        assert busy.status == 503 and b"shutting down" in busy.body
        # The metrics port keeps answering the probe while the drain lasts.
        reply = await request(metrics_port, "GET", "/readyz")
        assert reply.status == 503

        reply = await rest_of(stream)
        assert reply.header("transfer-encoding") == b"chunked" and reply.complete
        assert reply.body.endswith(b"data: [DONE]\n\n"), reply.body[-200:]
        assert reply.body.count(b"data: {") == 40
        assert await asyncio.to_thread(daemon.proc.wait, 30) == 0
        assert decode.aborted_streams == 0
        probe[1].close()
        worker[1].close()
    assert "drained; exiting" in daemon.output()


async def _readyz_when_draining(connection):
    reply = await exchange(*connection, "GET", "/readyz")
    return reply if reply.status == 503 else None


async def test_sigint_drains_like_sigterm():
    async with daemon_in_front(10, 0.1, drain=25) as (daemon, decode):
        stream = await stream_in_flight(daemon.port)
        daemon.proc.send_signal(signal.SIGINT)
        reply = await rest_of(stream)
        assert reply.complete  # the last chunk came
        assert await asyncio.to_thread(daemon.proc.wait, 30) == 0


async def test_idle_daemon_exits_at_once_on_sigterm():
    async with daemon_in_front(4, 0, drain=25) as (daemon, decode):
        idle = await keep_alive(daemon.port)
        daemon.proc.send_signal(signal.SIGTERM)
        # Nothing in flight: no waiting for the drain deadline (25 s).
        assert await asyncio.to_thread(daemon.proc.wait, 10) == 0
        assert await asyncio.wait_for(idle[0].read(), 5) == b""  # closed
        idle[1].close()


async def test_second_signal_exits_at_once():
    async with daemon_in_front(100000, 0.05, drain=120) as (daemon, decode):
        stream = await stream_in_flight(daemon.port)
        daemon.proc.send_signal(signal.SIGTERM)
        await eventually(lambda: refused(daemon.port), what="drain started")
        daemon.proc.send_signal(signal.SIGTERM)
        # Well before the 120 s drain or the hours-long stream could end.
        assert await asyncio.to_thread(daemon.proc.wait, 10) != 0
        reply = await rest_of(stream)
        assert not reply.complete  # cut, never completed
    assert "second signal" in daemon.output()


async def test_drain_deadline_cuts_what_is_still_running_and_exits_0():
    async with daemon_in_front(100000, 0.05, drain=0.5) as (daemon, decode):
        stream = await stream_in_flight(daemon.port)
        daemon.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(daemon.proc.wait, 15) == 0
        reply = await rest_of(stream)
        assert b"data: " in reply.body and not reply.complete  # cut
        # and said: "drained" alone hid that the deadline cut a stream
        assert "drain deadline (0.5s, PD_PROXY_DRAIN_SECONDS) cut 1 request(s)" \
            in daemon.output(), daemon.output()
