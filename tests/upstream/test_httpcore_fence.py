"""A fence around the httpcore internals lowproxy's upstream cycle relies on.

httpcore owns each upstream connection and lowproxy drives the request/response
cycle on the h11 state it keeps (lowproxy/upstream/httpcore_internals.py names every
internal used; lowproxy/upstream/cycle.py is the cycle):

- ``AsyncHTTP11Connection(origin, stream, keepalive_expiry=...)`` does no I/O;
- ``AsyncHTTP11Connection._h11_state`` is a fresh h11 client state with
  httpcore's head-size bound, ``_network_stream`` the stream it was built over;
- ``AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE`` is that bound.

And the h11 behaviours the cycle leans on (public API, but the cycle is only
correct while they hold): a head fed alone yields its event and leaves h11
empty; a bare terminating chunk completes a chunked body h11 saw only the head
of; bytes past a length-framed body stay in ``trailing_data``.

Each test names the internal it pins: when an httpcore release changes one,
the failure says which, and the upper bound in pyproject.toml must stay below
that release until upstream/httpcore_internals.py is adapted. Everything runs over real
sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import h11
import httpcore

from lowproxy.upstream.cycle import HeadReader, LengthRelay, finish_chunked, request_bytes
from lowproxy.upstream.httpcore_internals import MAX_HEAD_BYTES, adopt
from lowproxy.upstream.stream import AsyncioBackend, AsyncioStream

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
CHUNKED = HEAD + b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
LENGTH = HEAD + b"content-length: 5\r\n\r\nhello"
HINTS = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"


def fence(condition: object, internal: str, what: str) -> None:
    assert condition, (f"httpcore {httpcore.__version__} / h11 {h11.__version__} changed "
                       f"{internal}: {what}. lowproxy's upstream cycle relies on it; keep the "
                       "upper bound below this release until "
                       "lowproxy/upstream/httpcore_internals.py is adapted.")


@contextlib.asynccontextmanager
async def backend(*answers: bytes) -> AsyncIterator[int]:
    """A raw server that answers the n-th request on a connection with answers[n]."""
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


async def connection(port: int) -> tuple[httpcore.AsyncHTTP11Connection, AsyncioStream,
                                         h11.Connection]:
    """A connection set up exactly as Upstream._connect sets one up."""
    stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
    http, state = adopt(httpcore.Origin(b"http", b"127.0.0.1", port), stream, 5.0)
    return http, stream, state


async def cycle(stream: AsyncioStream, state: h11.Connection, port: int,
                on_informational: object = None) -> tuple[h11.Response, bytes]:
    """One GET, driven as Upstream._send and UpstreamResponse.deliver_body drive it."""
    head = HeadReader(state, stream, on_informational)  # type: ignore[arg-type]
    stream.attach(head)
    assert stream.send_now(request_bytes(state, b"GET", b"/x",
                                         [(b"host", b"127.0.0.1:%d" % port)], None))
    while not head.done:
        await head.wait()
    assert head.response is not None, head.error
    parts: list[bytes] = []
    relay = LengthRelay(state, stream, lambda pieces: parts.extend(pieces) or False)
    stream.set_sink(relay)
    relay.start()
    if head.rest:
        relay.data_received(head.rest)
    while not relay.done and relay.error is None:
        await relay.wait()
    stream.detach()
    return head.response, b"".join(parts)


def test_the_connection_class_still_has_what_upstream_touches():
    cls = httpcore.AsyncHTTP11Connection
    fence(isinstance(getattr(cls, "MAX_INCOMPLETE_EVENT_SIZE", None), int)
          and MAX_HEAD_BYTES == cls.MAX_INCOMPLETE_EVENT_SIZE,
          "AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE", "the head-size bound is gone")
    fence(isinstance(h11.Connection(h11.CLIENT).trailing_data, tuple),
          "h11.Connection.trailing_data", "no longer a (bytes, closed) pair")


async def test_adopting_a_stream_does_no_io_and_keeps_a_fresh_client_state():
    async with backend(LENGTH) as port:
        stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
        http = httpcore.AsyncHTTP11Connection(httpcore.Origin(b"http", b"127.0.0.1", port),
                                              stream, keepalive_expiry=5.0)
        state = getattr(http, "_h11_state", None)
        fence(isinstance(state, h11.Connection), "AsyncHTTP11Connection._h11_state",
              "the connection no longer keeps its h11 state there")
        assert isinstance(state, h11.Connection)
        fence(state.our_role is h11.CLIENT and state.our_state is h11.IDLE
              and state.their_state is h11.IDLE, "AsyncHTTP11Connection._h11_state",
              "not a fresh client state")
        fence(getattr(http, "_network_stream", None) is stream,
              "AsyncHTTP11Connection._network_stream", "not the stream it was built over")
        fence(stream.bytes_sent == 0 and stream.bytes_received == 0,
              "AsyncHTTP11Connection.__init__", "building the connection does I/O")
        stream.close()


async def test_two_cycles_on_the_adopted_state_leave_it_done_and_reusable():
    async with backend(LENGTH, LENGTH) as port:
        _, stream, state = await connection(port)
        for _ in range(2):
            response, body = await cycle(stream, state, port)
            fence(response.status_code == 200 and body == b"hello",
                  "AsyncHTTP11Connection._h11_state", "a cycle on it no longer reads the answer")
            fence(state.our_state is h11.DONE and state.their_state is h11.DONE
                  and state.trailing_data == (b"", False), "h11.Connection",
                  "a complete cycle no longer leaves both sides DONE and nothing buffered")
            state.start_next_cycle()
        stream.close()


async def test_a_head_fed_alone_leaves_the_body_to_the_relay():
    async with backend(CHUNKED, LENGTH) as port:
        _, stream, state = await connection(port)
        head = HeadReader(state, stream, None)
        stream.attach(head)
        stream.send_now(request_bytes(state, b"GET", b"/x", [(b"host", b"h")], None))
        while not head.done:
            await head.wait()
        fence(head.response is not None and state.trailing_data == (b"", False),
              "h11.Connection.next_event", "h11 kept bytes of a head fed to it whole")
        while b"0\r\n\r\n" not in head.rest:  # the body, read past h11 as ChunkedRelay does
            await asyncio.sleep(0.01)
        stream.detach()
        finish_chunked(state)
        fence(state.their_state is h11.DONE, "h11.Connection.receive_data",
              "a bare terminating chunk no longer completes a chunked response")
        state.start_next_cycle()
        response, body = await cycle(stream, state, port)
        fence(body == b"hello" and state.their_state is h11.DONE, "h11.Connection",
              "the next cycle after a bare terminating chunk broke")
        stream.close()


async def test_informational_heads_come_before_the_final_one():
    async with backend(HINTS + LENGTH) as port:
        _, stream, state = await connection(port)
        seen: list[tuple[int, list[tuple[bytes, bytes]]]] = []
        response, body = await cycle(stream, state, port,
                                     lambda status, headers: seen.append((status, headers)))
        fence(response.status_code == 200 and body == b"hello"
              and seen == [(103, [(b"link", b"</a>")])], "h11.InformationalResponse",
              "1xx heads no longer parse as their own events before the final head")
        stream.close()


async def test_bytes_past_a_length_framed_body_stay_in_trailing_data():
    async with backend(LENGTH + b"HTTP/1.1 200 OK\r\n") as port:
        _, stream, state = await connection(port)
        _, body = await cycle(stream, state, port)
        # Upstream refuses to pool exactly this: data h11 kept past the response.
        fence(body == b"hello" and state.trailing_data[0] == b"HTTP/1.1 200 OK\r\n",
              "h11.Connection.trailing_data", "bytes past a response are no longer kept there")
        stream.close()
