"""A fence around the httpcore internals lowproxy's upstream fast path relies on.

lowproxy uses httpcore's AsyncHTTP11Connection below its pool and bends it in
ways httpcore does not promise (see lowproxy/upstream/stream.py):

- ``_state_lock`` is replaced by a lock that never waits, so that closing a
  response never suspends (cleanup in a cancelled task's finally);
- ``_h11_state`` is replaced by an h11.Connection subclass that reports the
  1xx responses httpcore skips, and is read (its public ``trailing_data``) to
  find bytes past the end of a response;
- the response head is read with the stream cutting reads at the head's end
  (head-only), and httpcore must not read further before returning it;
- a chunked body is decoded outside h11 and h11 is then handed a bare
  terminating chunk, which must complete the exchange as if h11 had read it;
- ``is_idle``, ``is_available`` and ``has_expired`` (through the stream's
  ``is_readable``) decide pooling; ``request.stream`` is dropped once the head
  is in.

Each test names the internal it pins: when an httpcore release changes one,
the failure says which, and the upper bound in pyproject.toml must stay below
that release until upstream/stream.py is adapted. Everything runs over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import h11
import httpcore
import pytest

from lowproxy.upstream.stream import AsyncioBackend, AsyncioStream, H11Client, http11_connection

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
CHUNKED = HEAD + b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
LENGTH = HEAD + b"content-length: 5\r\n\r\nhello"


def fence(condition: object, internal: str, what: str) -> None:
    assert condition, (f"httpcore {httpcore.__version__} changed {internal}: {what}. "
                       "lowproxy/upstream/stream.py relies on it; keep httpcore's upper bound "
                       "below this release until stream.py is adapted.")


def never_suspends(coro: Coroutine[Any, Any, Any]) -> bool:
    """Run ``coro`` one step: True if it finished without yielding to the loop."""
    try:
        coro.send(None)
    except StopIteration:
        return True
    coro.close()
    return False


@contextlib.asynccontextmanager
async def backend(*answers: bytes, then_close: bool = False) -> AsyncIterator[int]:
    """A raw server that answers the n-th request on a connection with answers[n],
    then waits for the client to close (or closes itself, ``then_close``)."""
    serving: list[asyncio.Task[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        serving.append(task)
        try:
            for wire in answers:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(wire)
                await writer.drain()
            if not then_close:
                await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await asyncio.wait_for(asyncio.gather(*serving), 5)


async def connection(port: int, keepalive: float | None = None
                     ) -> tuple[httpcore.AsyncHTTP11Connection, AsyncioStream, H11Client]:
    """A connection set up exactly as Upstream._connect sets one up."""
    stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
    origin = httpcore.Origin(b"http", b"127.0.0.1", port)
    plain = httpcore.AsyncHTTP11Connection(origin, stream)
    fence(hasattr(getattr(plain, "_state_lock", None), "__aenter__"),
          "AsyncHTTP11Connection._state_lock", "the connection's state lock is gone or renamed")
    fence(isinstance(getattr(plain, "_h11_state", None), h11.Connection),
          "AsyncHTTP11Connection._h11_state", "the connection no longer keeps its h11 state there")
    http, state = http11_connection(origin, stream, keepalive)
    return http, stream, state


def request(port: int) -> httpcore.Request:
    url = httpcore.URL(scheme=b"http", host=b"127.0.0.1", port=port, target=b"/x")
    return httpcore.Request(b"GET", url, headers=[(b"host", b"127.0.0.1")])


def test_the_connection_class_still_has_what_upstream_touches():
    cls = httpcore.AsyncHTTP11Connection
    fence(isinstance(getattr(cls, "MAX_INCOMPLETE_EVENT_SIZE", None), int),
          "AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE", "H11Client is built with it")
    for name in ("handle_async_request", "is_idle", "is_available", "has_expired",
                 "_response_closed", "_receive_event"):
        fence(callable(getattr(cls, name, None)), f"AsyncHTTP11Connection.{name}", "missing")
    for method in (cls.handle_async_request, cls._response_closed):
        fence("async with self._state_lock" in inspect.getsource(method),
              "AsyncHTTP11Connection._state_lock",
              f"{method.__name__} no longer guards the connection's state with it")
    fence("self._h11_state.next_event()" in inspect.getsource(cls._receive_event),
          "AsyncHTTP11Connection._h11_state",
          "httpcore no longer parses events with _h11_state.next_event()")
    fence(isinstance(h11.Connection(h11.CLIENT).trailing_data, tuple),
          "h11.Connection.trailing_data", "no longer a (bytes, closed) pair")


async def test_the_replaced_state_lock_is_what_httpcore_enters():
    entered: list[str] = []

    class Counting:
        async def __aenter__(self) -> None:
            entered.append("enter")

        async def __aexit__(self, *exc: object) -> None:
            return None

    async with backend(LENGTH) as port:
        http, stream, _ = await connection(port)
        http._state_lock = Counting()  # type: ignore[assignment]
        response = await http.handle_async_request(request(port))
        body = b"".join([chunk async for chunk in response.stream])  # type: ignore[union-attr]
        await response.stream.aclose()  # type: ignore[union-attr]
        stream.close()
    assert body == b"hello"
    fence(entered == ["enter", "enter"], "AsyncHTTP11Connection._state_lock",
          f"expected to be entered once to start and once to close an exchange, got {entered}")


async def test_closing_a_finished_response_never_suspends():
    async with backend(LENGTH) as port:
        http, stream, _ = await connection(port)
        response = await http.handle_async_request(request(port))
        async for _ in response.stream:  # type: ignore[union-attr]
            pass
        closing = response.stream.aclose()  # type: ignore[union-attr]
        fence(never_suspends(closing), "HTTP11ConnectionByteStream.aclose",
              "closing a response read to its end now waits on the event loop")
        fence(http.is_idle() and http.is_available(), "AsyncHTTP11Connection.is_idle",
              "a finished exchange no longer leaves the connection idle and available")
        stream.close()


async def test_a_head_only_read_leaves_the_body_unread_and_h11_empty():
    async with backend(LENGTH) as port:
        http, stream, state = await connection(port)
        stream.head_only = True
        response = await http.handle_async_request(request(port))
        stream.head_only = False
        fence(response.status == 200 and state.trailing_data == (b"", False),
              "AsyncHTTP11Connection.handle_async_request",
              "it read past the response head before returning it")
        fence(response.headers == [(b"content-type", b"text/plain"), (b"content-length", b"5")],
              "Response.headers", "no longer the head's raw (name, value) pairs")
        fence(await stream.read(100) == b"hello", "AsyncHTTP11Connection.handle_async_request",
              "the body was taken from the stream with the head")
        stream.close()


async def test_an_injected_terminating_chunk_completes_the_exchange():
    async with backend(CHUNKED, LENGTH) as port:
        http, stream, state = await connection(port)
        stream.head_only = True
        first = request(port)
        response = await http.handle_async_request(first)
        stream.head_only = False
        first.stream = ()  # what Upstream does once the head is in
        await asyncio.sleep(0)
        # The body, read past h11 as the chunked relay reads it.
        body = b""
        while not body.endswith(b"0\r\n\r\n"):
            body += await stream.read(100)
        stream.inject(b"0\r\n\r\n")
        leftover = [chunk async for chunk in response.stream]  # type: ignore[union-attr]
        await response.stream.aclose()  # type: ignore[union-attr]
        fence(leftover == [] and http.is_idle() and state.trailing_data == (b"", False),
              "HTTP11ConnectionByteStream / _receive_response_body",
              "a bare terminating chunk no longer completes a chunked response")
        # The connection is reusable: the next exchange parses cleanly.
        response = await http.handle_async_request(request(port))
        body = b"".join([chunk async for chunk in response.stream])  # type: ignore[union-attr]
        await response.stream.aclose()  # type: ignore[union-attr]
        fence(body == b"hello" and http.is_idle(), "AsyncHTTP11Connection._response_closed",
              "the next cycle after an injected terminator broke")
        stream.close()


async def test_the_replaced_h11_state_sees_informational_responses():
    hints = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
    async with backend(hints + LENGTH) as port:
        http, stream, state = await connection(port)
        seen: list[tuple[int, list[tuple[bytes, bytes]]]] = []
        state.on_informational = lambda status, headers: seen.append((status, headers))
        stream.head_only = True
        response = await http.handle_async_request(request(port))
        stream.head_only = False
        fence(response.status == 200, "AsyncHTTP11Connection._receive_response_headers",
              "1xx responses are no longer skipped before the final one")
        fence(seen == [(103, [(b"link", b"</a>")])], "AsyncHTTP11Connection._h11_state",
              "httpcore no longer parses with the h11 state lowproxy puts there")
        await response.stream.aclose()  # type: ignore[union-attr]
        stream.close()


async def test_trailing_bytes_stay_in_h11_after_the_cycle():
    async with backend(LENGTH + b"HTTP/1.1 200 OK\r\n") as port:
        http, stream, state = await connection(port)
        response = await http.handle_async_request(request(port))
        async for _ in response.stream:  # type: ignore[union-attr]
            pass
        await response.stream.aclose()  # type: ignore[union-attr]
        # Upstream refuses to pool exactly this: data h11 kept past the response.
        fence(state.trailing_data[0] == b"HTTP/1.1 200 OK\r\n" or not http.is_idle(),
              "AsyncHTTP11Connection._response_closed",
              "bytes past a response are neither kept in _h11_state nor make the "
              "connection unusable")
        stream.close()


async def test_has_expired_reads_the_stream_and_the_keepalive_expiry():
    async with backend(LENGTH, LENGTH) as port:
        http, stream, _ = await connection(port, keepalive=0.05)
        response = await http.handle_async_request(request(port))
        async for _ in response.stream:  # type: ignore[union-attr]
            pass
        await response.stream.aclose()  # type: ignore[union-attr]
        fence(not http.has_expired(), "AsyncHTTP11Connection.has_expired",
              "a fresh idle connection counts as expired")
        started = time.monotonic()
        while not http.has_expired() and time.monotonic() - started < 5:
            await asyncio.sleep(0.01)
        fence(http.has_expired(), "AsyncHTTP11Connection.has_expired",
              "keepalive_expiry no longer expires an idle connection")
        stream.close()
    async with backend(LENGTH, then_close=True) as port:
        http, stream, _ = await connection(port)
        response = await http.handle_async_request(request(port))
        async for _ in response.stream:  # type: ignore[union-attr]
            pass
        await response.stream.aclose()  # type: ignore[union-attr]
        started = time.monotonic()
        while not stream.at_eof and time.monotonic() - started < 5:
            await asyncio.sleep(0.01)  # the backend closes after its one answer
        fence(http.has_expired(), "AsyncHTTP11Connection.has_expired",
              "no longer asks the stream's get_extra_info('is_readable') on an idle connection")
        stream.close()


@pytest.mark.parametrize("hang_up", ["fin", "reset"])
async def test_a_backend_hanging_up_before_answering_surfaces_as_caught(hang_up):
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if hang_up == "reset":
            writer.transport.abort()
        else:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        http, stream, _ = await connection(port)
        with pytest.raises(Exception) as caught:
            await http.handle_async_request(request(port))
        fence(isinstance(caught.value, (httpcore.RemoteProtocolError, httpcore.NetworkError)),
              "AsyncHTTP11Connection.handle_async_request",
              f"a hang-up before the answer raises {type(caught.value).__name__}, which "
              "Upstream._send does not treat as a closed connection")
        fence(http.is_closed(), "AsyncHTTP11Connection.handle_async_request",
              "a failed exchange no longer closes its connection")
    finally:
        server.close()
