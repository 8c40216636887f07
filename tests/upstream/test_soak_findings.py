"""What bench/soak.py found in lowproxy itself, each reduced to one exchange over sockets.

Stray bytes that are already in the kernel when a pooled connection is checked out.
The idle watch (upstream/pool.py _finish) drops a pooled connection when its
data_received callback runs, and the checkout asks httpcore's ``has_expired()``,
which asks the stream ``is_readable``; lowproxy's AsyncioStream answers that from
what its protocol has buffered only. Bytes the backend wrote while the connection
sat idle, that the kernel holds but the event loop has not handed over yet (a busy
loop: milliseconds under the soak's load), are then read as the next request's
answer. The backend wrote them before the proxy wrote that request, so this is not
HTTP/1.1's unavoidable race: httpcore's own streams answer ``is_readable`` by
polling the socket (httpcore._utils.is_socket_readable), and so must ours.
"""

from __future__ import annotations

import asyncio
import select

from helpers import RawServer, read_request
from lowproxy.config import Config, parse_endpoint
from lowproxy.tls import TrustStore
from lowproxy.upstream import Endpoint, Upstream


def answer(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(body)) + body


FORGED = answer(b'{"forged": true}')


class Backend:
    """A raw keep-alive backend: answer n to its n-th request; keeps each writer so the
    test can write on a connection while it is idle in the proxy's pool."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.requests += 1
                writer.write(answer(b'{"answer": %d}' % self.requests))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await asyncio.gather(*self.tasks)  # each sees its connection end
        await self.server.wait_closed()


async def test_stray_bytes_in_the_kernel_at_checkout_are_never_the_next_answer() -> None:
    backend = Backend()
    spec = parse_endpoint(await backend.start())
    upstream = Upstream(Config(decode=(spec,)), TrustStore(None))
    endpoint = Endpoint(spec)
    try:
        response = await upstream.request(endpoint, b"POST", b"/v1/x", [], b"{}")
        assert await response.read(1 << 20) == b'{"answer": 1}'
        await response.aclose()
        assert len(endpoint.idle) == 1  # pooled, clean so far
        stream = endpoint.idle[0].stream
        assert stream is not None
        sock = stream.get_extra_info("socket")
        # From here to the checkout nothing yields to the event loop, as when the
        # loop is busy: the backend's stray response reaches the proxy's socket ...
        backend.writers[0].write(FORGED)  # an empty transport buffer: sent at once
        assert select.select([sock.fileno()], [], [], 5)[0], "stray never arrived"
        # ... and the next request is checked out before any callback ran.
        response = await upstream.request(endpoint, b"POST", b"/v1/x", [], b"{}")
        data = await response.read(1 << 20)
        await response.aclose()
        assert data != b'{"forged": true}', "a stray response was read as the answer"
        assert data == b'{"answer": 2}'
        assert len(backend.writers) == 2  # on a fresh connection
    finally:
        upstream.close_idle(endpoint)
        await backend.close()


class AnswersWhenReleased(RawServer):
    """Reads a request, then answers only once the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.received = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    number: int) -> None:
        while True:
            await read_request(reader)
            self.received += 1
            await self.release.wait()
            self.release.clear()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")


async def test_while_waiting_runs_once_the_request_is_sent_and_before_its_answer() -> None:
    """Upstream.request's while_waiting (relay prepares decode's body there): called
    once a leg is on its way, while the backend has not answered, so work done there
    overlaps the backend's; and, before a new connection is dialled, once more, so
    that a connect storm does not hold what it lets go of."""
    backend = await AnswersWhenReleased().start()
    spec = parse_endpoint(backend.url)
    upstream = Upstream(Config(decode=(spec,)), TrustStore(None))
    endpoint = Endpoint(spec)
    calls: list[tuple[int, int]] = []

    def while_waiting() -> None:
        calls.append((backend.connections, endpoint.open))
        backend.release.set()  # without this call the backend never answers

    try:
        for _ in range(2):  # a fresh connection, then the pooled one
            response = await asyncio.wait_for(
                upstream.request(endpoint, b"POST", b"/v1/x", [], b"{}",
                                 while_waiting=while_waiting), 5)
            assert await response.read(1 << 20) == b"ok"
            await response.aclose()
        # Dialling: nothing connected yet; sent, on the fresh connection; the pooled one.
        assert [opened for _, opened in calls] == [0, 1, 1]
        assert backend.received == 2 and backend.connections == 1
    finally:
        upstream.close_idle(endpoint)
        await backend.close()
