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
import json
import signal

from helpers import CHAT, Daemon, chat, eventually, exchange, follow_output, free_port, request
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


class Stream:
    """A streamed generation read event by event on its own connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.raw = b""

    @classmethod
    async def open(cls, port: int) -> Stream:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps(chat(stream=True)).encode()
        writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (CHAT.encode(), len(body), body))
        stream = cls(reader, writer)
        while b"data: " not in stream.raw:  # the stream is in flight
            stream.raw += await asyncio.wait_for(reader.read(65536), 10)
        return stream

    async def rest(self, timeout: float = 30.0) -> bytes:
        """Read to the end of the response (a last chunk) or of the connection."""
        while not self.raw.endswith(b"\r\n0\r\n\r\n"):
            try:
                data = await asyncio.wait_for(self.reader.read(65536), timeout)
            except ConnectionError:
                break
            if not data:
                break
            self.raw += data
        self.writer.close()
        return self.raw


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
        stream = await Stream.open(port)
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

        body = await stream.rest()
        assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), body[-200:]
        assert body.count(b"data: {") == 40
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
        stream = await Stream.open(daemon.port)
        daemon.proc.send_signal(signal.SIGINT)
        body = await stream.rest()
        assert body.endswith(b"\r\n0\r\n\r\n")
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
        stream = await Stream.open(daemon.port)
        daemon.proc.send_signal(signal.SIGTERM)
        await eventually(lambda: refused(daemon.port), what="drain started")
        daemon.proc.send_signal(signal.SIGTERM)
        # Well before the 120 s drain or the hours-long stream could end.
        assert await asyncio.to_thread(daemon.proc.wait, 10) != 0
        body = await stream.rest()
        assert not body.endswith(b"\r\n0\r\n\r\n")  # cut, never completed
    assert "second signal" in daemon.output()


async def test_drain_deadline_cuts_what_is_still_running_and_exits_0():
    async with daemon_in_front(100000, 0.05, drain=0.5) as (daemon, decode):
        stream = await Stream.open(daemon.port)
        daemon.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(daemon.proc.wait, 15) == 0
        body = await stream.rest()
        assert b"data: " in body and not body.endswith(b"\r\n0\r\n\r\n")  # cut
