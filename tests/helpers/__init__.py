"""Test plumbing: the HTTP client (client.py), scripted and raw backends, an in-process
proxy, a daemon process.

Everything talks over 127.0.0.1 sockets; nothing is mocked below HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, AsyncIterator, Iterable

from lowproxy.config import Config, parse_endpoint
from lowproxy.daemon import limits_of
from lowproxy.demo import DemoBackend, KvRegistry, start_pair
from lowproxy.downstream import HttpServer
from lowproxy.proxy import Proxy

from .client import Client, Reply, exchange, first_reply, parse_replies, request

__all__ = ["CHAT", "ROOT", "Client", "Daemon", "RawServer", "Reply", "RunningProxy",
           "ScriptedBackend", "chat", "client_for", "config_for", "demo_backends", "eventually",
           "exchange", "first_reply", "follow_output", "free_port", "legs", "parse_replies",
           "leave_after_both_legs", "pd_backends", "pd_setup", "raw_exchange", "tagged_chats",
           "read_request", "request", "running_proxy", "wait_until"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAT = "/v1/chat/completions"  # the path most tests send to


def chat(**extra: Any) -> dict[str, Any]:
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4}
    body.update(extra)
    return body


class RunningProxy:
    def __init__(self, proxy: Proxy, server: HttpServer) -> None:
        self.proxy = proxy
        self.server = server
        self.port = server.ports[0]

    async def request(self, method: str, target: str, body: Any = None, **kw: Any) -> Reply:
        return await request(self.port, method, target, body, **kw)


def config_for(prefill: Iterable[str] | str = (), decode: Iterable[str] | str = (),
               **overrides: Any) -> Config:
    prefill = [prefill] if isinstance(prefill, str) else list(prefill)
    decode = [decode] if isinstance(decode, str) else list(decode)
    overrides.setdefault("host", "127.0.0.1")
    overrides.setdefault("port", 0)
    # Most tests count backend requests exactly and expect prefill legs in turn:
    # no background health checks, round robin, unless a test asks otherwise.
    overrides.setdefault("health_interval", 0.0)
    overrides.setdefault("prefill_policy", "round-robin")
    return Config(prefill=tuple(parse_endpoint(u) for u in prefill),
                  decode=tuple(parse_endpoint(u) for u in decode), **overrides)


@contextlib.asynccontextmanager
async def running_proxy(config: Config, resolver: Any = None) -> AsyncIterator[RunningProxy]:
    """The proxy in this process, on an ephemeral port of 127.0.0.1."""
    proxy = Proxy(config, resolver=resolver)
    await proxy.start()
    server = HttpServer(proxy.handle, limits_of(config),
                        on_connections=lambda n: proxy.metrics.client_connections.add(n))
    await server.listen("127.0.0.1", 0)
    try:
        yield RunningProxy(proxy, server)
    finally:
        await server.drain(0)
        await proxy.close()


@contextlib.asynccontextmanager
async def pd_setup(kv_protocol: str = "relay", ranks: int = 1, **overrides: Any
                   ) -> AsyncIterator[tuple[RunningProxy, DemoBackend, DemoBackend]]:
    """Demo prefill and decode backends and a proxy in front of them.

    Under sglang they are strict SGLang PD servers: the decode refuses a leg
    without bootstrap_room, as SGLang's does.
    """
    prefill, decode = await start_pair(ranks=ranks, sglang_pd=kv_protocol == "sglang")
    prefill_url = f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}"
    overrides.setdefault("mooncake_bootstrap_port", prefill.bootstrap_port)
    try:
        async with running_proxy(config_for(prefill_url, decode.url, kv_protocol=kv_protocol,
                                            **overrides)) as running:
            yield running, prefill, decode
    finally:
        await prefill.close()
        await decode.close()


@contextlib.asynccontextmanager
async def demo_backends(count: int, role: str = "decode", **knobs: Any
                        ) -> AsyncIterator[list[DemoBackend]]:
    """``count`` demo backends of one role (no bootstrap server), closed after."""
    started: list[DemoBackend] = []
    try:
        for _ in range(count):
            started.append(await DemoBackend(role, **knobs).start(bootstrap_port=None))
        yield started
    finally:
        for backend in started:
            await backend.close()


@contextlib.asynccontextmanager
async def pd_backends(prefills: int = 2, decodes: int = 1, **knobs: Any
                      ) -> AsyncIterator[tuple[list[DemoBackend], list[DemoBackend]]]:
    """Demo prefills and decodes sharing one KV registry, closed after."""
    registry = KvRegistry()
    pre = [await DemoBackend("prefill", registry=registry, **knobs).start()
           for _ in range(prefills)]
    dec = [await DemoBackend("decode", registry=registry, **knobs).start(bootstrap_port=None)
           for _ in range(decodes)]
    try:
        yield pre, dec
    finally:
        for backend in pre + dec:
            await backend.close()


def legs(prefill: DemoBackend, decode: DemoBackend, path: str = "/chat/completions"
         ) -> tuple[list[Any], list[Any]]:
    """The prefill and decode legs as the two backends received them."""
    return prefill.requests_to(path), decode.requests_to(path)


async def tagged_chats(proxy: RunningProxy, count: int) -> list[Reply]:
    """``count`` chat requests at once, each with its own x-request-id r0, r1, ...; all 200."""
    replies = await asyncio.gather(*(
        proxy.request("POST", CHAT, chat(), headers=[("x-request-id", f"r{i}")])
        for i in range(count)))
    assert [r.status for r in replies] == [200] * count
    return replies


async def leave_after_both_legs(proxy: RunningProxy, prefill: Any, decode: Any, body: Any,
                                path: str = CHAT) -> None:
    """A client that sends ``body`` and hangs up once both legs have reached the backends."""
    client = await Client.open(proxy.port)
    client.send("POST", path, body)
    await wait_until(lambda: decode.requests_to(path) and prefill.requests_to(path),
                     what="both legs sent")
    client.close()


def client_for(port: int) -> Any:
    """The openai SDK in front of a proxy on ``port`` (no retries: a failure shows)."""
    import openai

    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                              max_retries=0, timeout=10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """``python -m lowproxy`` as a child process, for start-up, signals and exit codes."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("PD_PROXY_", "ADMIN_API_KEY"))}
        full_env.update(env or {})
        full_env.setdefault("PYTHONPATH", ROOT)
        self.proc = subprocess.Popen([sys.executable, "-m", "lowproxy", *args], env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
        self.port = 0
        self.lines: list[str] = []

    def wait_listening(self, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline().decode(errors="replace")
            if not line:
                if self.proc.poll() is not None:
                    raise AssertionError(f"daemon exited {self.proc.returncode}: {self.lines}")
                continue
            self.lines.append(line)
            match = re.search(r"listening on \S+:(\d+)", line)
            if match:
                self.port = int(match.group(1))
                return self.port
        raise AssertionError(f"daemon did not start: {self.lines}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._collect()

    def _collect(self) -> None:
        """Once the process has exited: keep what it still wrote, close the pipes."""
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is None or pipe.closed:
                continue
            try:
                rest = pipe.read().decode(errors="replace")
            except ValueError:  # closed by a follow_output thread meanwhile
                rest = ""
            if pipe is self.proc.stderr and rest:
                self.lines.append(rest)
            pipe.close()

    def output(self) -> str:
        if self.proc.poll() is not None:
            self._collect()
        return "".join(self.lines)


async def eventually(predicate: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    """Await ``predicate()`` (a coroutine function) until it returns something true."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def wait_until(predicate: Any, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``predicate()`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- raw-byte backends (the backend is the attacker)


class RawServer:
    """A backend written in raw bytes. Subclasses define ``serve(reader, writer, number)``
    (``number``: this connection's, from 1); a hang-up ends it quietly, and the
    connection is closed however it ends."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections = 0

    async def start(self) -> Any:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.serve(reader, writer, self.connections)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    number: int) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and its content-length body, read from a raw connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


# -- scripted and TLS backends (tests of headers, relay, TLS)


class ScriptedBackend:
    """A backend on lowproxy's HttpServer whose answer is the test's own coroutine.

    ``answer(request, responder)`` writes the response; every request is recorded in
    ``received`` first. ``hung_up`` counts requests whose caller closed the connection
    while ``answer`` was still running (the backend watches its client as vLLM does).
    """

    def __init__(self, answer: Any = None) -> None:
        from lowproxy.demo import Received

        self._received_type = Received
        self.answer = answer or _echo_answer
        self.received: list[Any] = []
        self.hung_up = 0
        self.server = HttpServer(self._handle)
        self.port = 0

    async def start(self, ssl: Any = None, host: str = "127.0.0.1") -> ScriptedBackend:
        await self.server.listen(host, 0, ssl=ssl)
        self.port = self.server.ports[0]
        return self

    def url(self, scheme: str = "http", host: str = "127.0.0.1") -> str:
        return f"{scheme}://{host}:{self.port}"

    async def close(self) -> None:
        await self.server.drain(0)

    async def _handle(self, request: Any, responder: Any) -> None:
        try:
            body = json.loads(request.body) if request.body else None
        except ValueError:
            body = None
        self.received.append(self._received_type(
            request.method.decode(), request.path, request.target.decode("latin-1"),
            request.headers, body, request.body))
        request.watch_client()
        try:
            await self.answer(request, responder)
        except asyncio.CancelledError:
            if responder.client_gone:
                self.hung_up += 1
            raise


async def _echo_answer(request: Any, responder: Any) -> None:
    await responder.send_json(200, {"path": request.path,
                                    "target": request.target.decode("latin-1")})



# -- raw sockets (limits, smuggling, fuzzing)


async def raw_exchange(port: int, data: bytes, *, half_close: bool = False,
                       timeout: float = 5.0) -> bytes:
    """Send ``data`` as is and return every byte the server sends until it closes.

    Fails (TimeoutError) when the server keeps the connection open longer than
    ``timeout``: callers use it to check that a connection was closed.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunks: list[bytes] = []
    try:
        writer.write(data)
        await writer.drain()
        if half_close:
            writer.write_eof()
        await asyncio.wait_for(_read_to_close(reader, chunks), timeout)
    finally:
        writer.close()
    return b"".join(chunks)


async def _read_to_close(reader: asyncio.StreamReader, chunks: list[bytes]) -> None:
    while True:
        try:
            chunk = await reader.read(65536)
        except ConnectionError:
            return
        if not chunk:
            return
        chunks.append(chunk)


def follow_output(daemon: Daemon) -> threading.Thread:
    """Keep reading a running daemon's stderr into ``daemon.lines``.

    A daemon that logs more than a pipe holds (64 KiB) would block on its next
    log line; call this after ``wait_listening`` in long tests, and join the
    thread after the daemon exits before reading ``daemon.output()``.
    """
    assert daemon.proc.stderr is not None
    stderr = daemon.proc.stderr

    def pump() -> None:
        for line in iter(stderr.readline, b""):
            daemon.lines.append(line.decode(errors="replace"))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread
