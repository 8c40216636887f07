"""One request/response cycle on an upstream connection, driven on its h11 state.

The connection is httpcore's (httpcore_internals.py); the cycle is lowproxy's:
the request goes out as h11 serialises it (head, body, end: one write), and the
response is parsed in the connection's data_received callback by the sinks
here, so a response that arrives in one segment costs one task wake-up:

- HeadReader cuts each head at its blank line and hands h11 exactly that, so
  h11 never holds body bytes (h11_internals.receive_head: the common head
  parsed by one regex and a split, the event through h11's state machine);
  1xx heads go to a callback (RFC 9110 section 15.2), the final one wakes
  the waiting request; bytes after it are kept for the body's relay.
- LengthRelay feeds h11 a body it frames itself (Content-Length, no body, or
  to the close) and delivers h11's Data events.
- A chunked body goes through chunked.ChunkedRelay, which decodes it without
  h11; h11 is then handed the bare terminating chunk, so its state completes
  as if it had read the body itself.

Nothing here suspends but ``wait``; what a callback raised is kept and raised
again by the coroutine waiting on the cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import h11

from ..h11_internals import (
    BLANK_LINE,
    next_event,
    receive_head,
    send_data,
    send_end,
    send_request,
    without_quoted_bytes,
)
from .chunked import Deliver, Waiting
from .httpcore_internals import MAX_HEAD_BYTES
from .stream import READ_HIGH_WATER, AsyncioStream

# Go's transport's bound (max1xxResponses): a backend that sends 1xx heads for
# ever must not hold the request, nor grow what is written to a slow client.
MAX_INFORMATIONAL = 5
# Called with (status, headers) for each 1xx response before the final one.
Informational = Callable[[int, list[tuple[bytes, bytes]]], None]
Headers = list[tuple[bytes, bytes]]

_Response = h11.Response
_Informational = h11.InformationalResponse
_Data = h11.Data
_EndOfMessage = h11.EndOfMessage


class HeadError(Exception):
    """The backend's response head is broken, or too large."""


class BodyError(Exception):
    """The backend's body broke its framing, or ended before its end."""


def request_bytes(state: h11.Connection, method: bytes, target: bytes, headers: Headers,
                  body: bytes | None) -> bytes:
    """The request as h11 serialises it: head, body and end, for one write.

    The head is built without h11's per-header checks (lowproxy/h11_internals/):
    every name and value comes from h11's parser or from the proxy itself."""
    wire = send_request(state, method, target, headers)
    if body:
        wire += send_data(state, body)
    return wire + send_end(state)


def _head_problem(message: str) -> str:
    """h11's complaint about a head, in the operator's terms (its state names and
    buffer types are its own), without the backend's bytes it quotes: a header
    line may hold a key the backend reflects, and this text reaches log lines
    and, under PD_PROXY_ON_PREFILL_FAILURE=error, the client."""
    if "_SWITCH_UPGRADE" in message:
        return "101 Switching Protocols, though no upgrade was asked for"
    return without_quoted_bytes(message, "malformed response head")


class HeadReader(Waiting):
    """The connection's sink until the final response head is in (and its body relay
    attaches: until then it keeps what comes after the head)."""

    __slots__ = ("state", "on_informational", "response", "final", "error", "eof", "rest",
                 "_buffer", "_searched", "_informational")

    def __init__(self, state: h11.Connection, stream: AsyncioStream,
                 on_informational: Informational | None) -> None:
        self.state = state
        self.stream = stream
        self.on_informational = on_informational
        self.response: h11.Response | None = None  # taken by whoever reads the head
        self.final = False  # the final head is in
        self.error: BaseException | None = None
        self.eof: BaseException | bool = False  # the backend hung up (True or its error)
        self.rest = b""  # after the final head: the body's first bytes
        self._buffer = b""
        self._searched = 0
        self._informational = 0
        self._waiter = None

    @property
    def done(self) -> bool:
        return self.final or self.error is not None or self.eof is not False

    def data_received(self, data: bytes) -> None:
        if self.final or self.error is not None:
            self.rest += data
            if len(self.rest) > READ_HIGH_WATER:
                self.stream.pause_reading()  # the relay resumes it
            return
        buffer = self._buffer + data if self._buffer else data
        position = self._searched
        try:
            while True:
                match = BLANK_LINE.search(buffer, position)
                if match is None:
                    if len(buffer) > MAX_HEAD_BYTES:
                        raise HeadError(f"response head over {MAX_HEAD_BYTES} bytes")
                    self._buffer = buffer
                    self._searched = max(0, len(buffer) - 2)
                    return
                cut = match.end()
                event: Any = receive_head(self.state, buffer[:cut])
                buffer, position = buffer[cut:], 0
                kind = type(event)
                if kind is _Response:
                    self.response = event
                    self.final = True
                    self.rest, self._buffer = buffer, b""
                    break
                if kind is _Informational:
                    self._informational += 1
                    if self._informational > MAX_INFORMATIONAL:
                        raise HeadError(f"more than {MAX_INFORMATIONAL} informational (1xx) "
                                        "responses")
                    callback = self.on_informational
                    if callback is not None and event.status_code != 101:
                        callback(event.status_code, event.headers.raw_items())
                elif event is not h11.NEED_DATA:
                    raise HeadError(f"unexpected {kind.__name__} before the response head")
        except h11.RemoteProtocolError as exc:
            self.error = HeadError(_head_problem(str(exc)))
        except BaseException as exc:  # raised again by the waiting coroutine
            self.error = exc
        self._wake()

    def connection_closed(self, exc: BaseException | None) -> None:
        self.eof = exc if exc is not None else True
        self._wake()


class LengthRelay(Waiting):
    """A body h11 frames, fed to h11 as it arrives; its data delivered per read."""

    __slots__ = ("state", "deliver", "done", "error", "slow", "stray")

    def __init__(self, state: h11.Connection, stream: AsyncioStream, deliver: Deliver) -> None:
        self.state = state
        self.stream = stream
        self.deliver = deliver
        self.done = False
        self.error: BaseException | None = None
        self.slow = False
        self.stray = False  # bytes arrived after the body ended
        self._waiter = None

    def start(self) -> None:
        """Before any byte: a body h11 knows is empty (HEAD, 204, 304, length 0) ends now."""
        self._events()

    def data_received(self, data: bytes) -> None:
        if self.error is not None:
            return
        if self.done:
            self.stray = True
            return
        self.state.receive_data(data)
        self._events()
        if self.error is not None or self.slow or self.done:
            self._wake()

    def connection_closed(self, exc: BaseException | None) -> None:
        if self.error is None and not self.done:
            self.state.receive_data(b"")  # a body framed by the close ends here
            self._events()
            if self.error is None and not self.done:
                self.error = BodyError(f"connection closed mid-body{f': {exc}' if exc else ''}")
        self._wake()

    def _events(self) -> None:
        pieces: list[bytes] = []
        state = self.state
        try:
            while True:
                event: Any = next_event(state)
                kind = type(event)
                if kind is _Data:
                    pieces.append(bytes(event.data))
                elif kind is _EndOfMessage:
                    self.done = True
                    break
                else:  # NEED_DATA
                    break
            if pieces and self.deliver(pieces):
                self.slow = True
                self.stream.pause_reading()
        except h11.RemoteProtocolError as exc:
            self.error = BodyError(str(exc) or "malformed body")
        except BaseException as exc:  # raised again by the waiting coroutine
            self.error = exc


def finish_chunked(state: h11.Connection) -> None:
    """h11 completes a chunked body it saw only the head of (ChunkedRelay read it)."""
    state.receive_data(b"0\r\n\r\n")
    if type(state.next_event()) is not _EndOfMessage:  # pragma: no cover - fenced
        raise BodyError("h11 did not end the body at its last chunk")
