"""One client socket: h11 request cycles, one phase and its one timer, hang-up hook.

Cycles run in order (keep-alive and pipelining: a cycle finishes before the
next request is parsed, as in uvicorn's h11 protocol). Each cycle reads the
whole request body (bounded), hands a ClientRequest and a Responder to the
handler, and ends the connection when the exchange cannot continue cleanly.

Two phases of error: before a response has started the client gets a status
and a JSON body; after it has started the connection is aborted, so a cut
response never looks complete.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any, Awaitable, Callable

import h11

from .._types import Headers
from ..answers import REASONS, bad_gateway, canned_response, error_body, internal_error
from ..h11_internals import (
    END_OF_MESSAGE,
    next_event,
    receive_request,
    start_next_cycle,
    without_quoted_bytes,
)
from ..routes import speaks_anthropic
from ..timeouts import deadline
from .closing import closed
from .hangup import HangUpHook
from .limits import Limits, origin_target, oversized_head_status, refusal
from .messages import AbortResponse, ClientGone, ClientRequest, ResponseWriter
from .responder import Responder

log = logging.getLogger("lowproxy.server")

READ_SIZE = 64 * 1024
# A hang-up cancels a handler only once it has waited this long: an exchange that
# ends sooner still answers a client that half-closed after its request (a FIN
# reads the same as a close; only a write could tell them apart).
WATCH_AFTER = 0.05
# After refusing a request, how long and how much of its remaining input to drop.
LINGER_SECONDS = 2.0
LINGER_BYTES = 4 * 1024 * 1024
# A request body may come in at most max_body_bytes / CHUNK_COST pieces (131072
# for the default 32 MiB): each costs h11 and this loop far more than its bytes.
CHUNK_COST = 256
# A request body may take the head timeout plus a second per 16 KiB that came
# (32 MiB: 2048 s more); slower than that, the client is holding a slot.
MIN_BODY_RATE = 16 * 1024.0

Handler = Callable[[ClientRequest, ResponseWriter], Awaitable[None]]


class Phase(enum.Enum):
    """Where a connection is; the phase decides what its one timer means."""

    HEAD = "head"          # a request head is due: header timeout, then 408
    BODY = "body"          # a request body is arriving: inactivity timeout, then 408
    HANDLING = "handling"  # the handler runs: no timer (a generation may be long)
    IDLE = "idle"          # keep-alive between requests: idle timeout, quiet close
    REFUSED = "refused"    # a request was refused: lingering close follows
    CLOSED = "closed"      # the client ended its side between requests
    GONE = "gone"          # the client left mid-request, or a handler dropped it: abort


_FINAL = (Phase.REFUSED, Phase.CLOSED, Phase.GONE)
_DUE_408 = (Phase.HEAD, Phase.BODY)


class ClientConnection:
    """One client socket: the h11 state, its phase and timer, and its request cycles."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 handler: Handler, limits: Limits, is_draining: Callable[[], bool],
                 on_end: Callable[[ClientConnection], None] | None = None) -> None:
        self.reader = reader
        self.writer = writer
        self._on_end = on_end  # told once, as the connection is closed (the server's count)
        self.transport = writer.transport
        self.handler = handler
        self.limits = limits
        self._is_draining = is_draining
        # Cached: asyncio.get_running_loop() costs a getpid() syscall on 3.11.
        self._loop = asyncio.get_running_loop()
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.phase = Phase.HEAD
        # One lazy timer per connection (see _enter): when the phase's time is up,
        # and when the handle armed for it fires (never later than that).
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        # Armed no further ahead than this, so that no later phase finds it too late.
        self._arm_within = min(limits.header_timeout, limits.keepalive_timeout)
        # Whether the running handler asked for a hang-up to cancel it, and when
        # (watch_client).
        self._watching = False
        self._watch_since = 0.0
        self.transport.set_protocol(HangUpHook(self.transport.get_protocol(), self._hung_up))
        # Below this the transport never pauses the writer: a drain returns at once.
        try:
            self._low_water = self.transport.get_write_buffer_limits()[0]
        except (AttributeError, NotImplementedError):  # a transport without it: bound all
            self._low_water = 0
        self._head_bytes = 0
        self._body_until = 0.0  # a body's whole deadline (loop time), moved by what came
        self._head_reads: list[bytes] | None = None  # this cycle's reads until its head
        self._task: asyncio.Task[Any] | None = None

    # -- the Wire a Responder writes through

    @property
    def draining(self) -> bool:
        return self._is_draining()

    @property
    def gone(self) -> bool:
        return self.phase is Phase.GONE

    @property
    def busy(self) -> bool:
        """A request is being handled (a drain waits for it)."""
        return self.phase is Phase.HANDLING

    def write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ClientGone()
        self.transport.write(data)

    async def drain(self) -> None:
        if self.transport.is_closing():
            raise ClientGone()
        try:
            if self.limits.write_timeout and \
                    self.transport.get_write_buffer_size() > self._low_water:
                await self._drain_bounded(self.limits.write_timeout)
            else:
                await self.writer.drain()
        except (OSError, RuntimeError):  # ConnectionError, or the kernel's ETIMEDOUT
            raise ClientGone() from None

    async def _drain_bounded(self, seconds: float) -> None:
        """The drain, given up when a whole ``seconds`` pass with nothing taken of the
        buffer (nginx's send_timeout: between two writes, not for the whole drain):
        a client that reads slowly stays, one that stopped reading lets its decode go."""
        size = self.transport.get_write_buffer_size()
        while True:
            try:
                async with deadline(seconds):
                    await self.writer.drain()
                return
            except TimeoutError:
                left = self.transport.get_write_buffer_size()
                if left < size:  # it took some: wait again
                    size = left
                    continue
                log.info("client took nothing for %gs (PD_PROXY_CLIENT_WRITE_TIMEOUT_SECONDS): "
                         "taken as gone", seconds)
                self.drop()
                raise ClientGone() from None

    def write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size()

    def drop(self) -> None:
        self.phase = Phase.GONE
        self.abort()

    # -- the phase and its one timer

    def _enter(self, phase: Phase, seconds: float | None = None) -> None:
        """Move to ``phase`` (never out of a final one) and set its deadline, if any.

        Lazily: a request moves through three timed phases in well under a
        millisecond, so the timer is re-armed only when it fires early (the
        deadline moved on meanwhile) or would fire too late. A request costs
        two timer operations (armed at keep-alive, cancelled when its handler
        starts), none for its head and body phases.
        """
        self._deadline = None
        if self.phase in _FINAL and phase not in _FINAL:
            return
        self.phase = phase
        if seconds is not None:
            now = self._loop.time()
            deadline = self._deadline = now + seconds
            if self._timer is None or self._timer_at > deadline:
                self._arm(now, deadline)

    def _arm(self, now: float, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        when = self._timer_at = min(deadline, now + self._arm_within)
        self._timer = self._loop.call_at(when, self._expired)

    def _disarm(self) -> None:
        self._deadline = None  # the armed handle, if any, finds nothing to do

    def _cancel_timer(self) -> None:
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return
        now = self._loop.time()
        if now < deadline:
            self._arm(now, deadline)  # the phase moved on since this handle was armed
            return
        self._deadline = None
        if self.phase in _DUE_408 and not self.transport.is_closing():
            # RFC 9110 15.5.9: a 408 tells the client why before the close.
            self.transport.write(canned_response(
                408, error_body(408, "request not received in time", "request_timeout")))
        self.close()

    def close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        self.transport.abort()

    # -- reading, and watching for a hang-up while a handler waits

    async def _read(self) -> bytes:
        if self.phase in (Phase.GONE, Phase.CLOSED):
            return b""
        try:
            return await self.reader.read(READ_SIZE)
        except (ConnectionError, OSError):
            return b""

    def watch_client(self) -> None:
        """While a handler waits on a backend, let a hang-up cancel it.

        The handler's task is cancelled, which closes its upstream exchange at
        once (a decode server aborts the request when its connection drops).
        The transport keeps reading while the handler runs (the hang-up hook
        sees EOF and resets as they arrive); bytes of a pipelined next request
        stay in the reader's buffer for the next cycle, and past its limit
        reading pauses and TCP pushes back.
        """
        if not self.gone:
            self._watching = True
            self._watch_since = self._loop.time()

    def _hung_up(self) -> None:
        """The client sent EOF or the connection was lost (HangUpHook)."""
        if self._watching and self.phase is Phase.HANDLING and self._task is not None:
            # Mid-request: the client left. Between requests, an EOF only means
            # no more requests, which the next read finds.
            wait = self._watch_since + WATCH_AFTER - self._loop.time()
            if wait > 0:  # rare: a timer only for a hang-up in the first WATCH_AFTER
                self._loop.call_later(wait, self._hung_up)
                return
            self._watching = False
            self.phase = Phase.GONE
            self._task.cancel()

    async def _next_event(self, buffered: bool = True) -> Any:
        """h11's next event, reading as it needs; ``buffered=False``: h11 holds
        nothing yet (it would only say NEED_DATA), so read first."""
        conn = self.h11
        while True:
            if buffered:
                event = next_event(conn)
                if event is not h11.NEED_DATA:
                    return event
            buffered = True
            data = await self._read()
            self._head_bytes += len(data)
            if self._head_reads is not None:
                self._head_reads.append(data)
            if data and self.phase is Phase.IDLE:
                self._enter(Phase.HEAD, self.limits.header_timeout)
            elif data and self.phase is Phase.BODY:
                # Each read re-arms the head timeout, within a whole deadline that
                # grows by what came at MIN_BODY_RATE: a byte every 29 s held a
                # slot for ever (10000 of them for ~350 B/s).
                self._body_until += len(data) / MIN_BODY_RATE
                self._enter(Phase.BODY, min(self.limits.header_timeout,
                                            self._body_until - self._loop.time()))
            if self._head_reads is not None:  # a request's head, most often whole in one read
                event = receive_request(conn, data)
                if event is not h11.NEED_DATA:
                    return event
                buffered = False  # h11 just said so: read on
                continue
            conn.receive_data(data)

    # -- request cycles

    async def run(self) -> None:
        self._task = asyncio.current_task()
        limits = self.limits
        first = True
        try:
            while not self.transport.is_closing():
                if first:
                    self._enter(Phase.HEAD, limits.header_timeout)
                else:
                    self._enter(Phase.IDLE, limits.keepalive_timeout)
                first = False
                # One request and its response, awaited here and not in a method of
                # their own: a frame fewer held by every open stream.
                request = await self._receive_request()
                if request is None or not await self._respond(request):
                    break
                start_next_cycle(self.h11)
        except ClientGone:
            pass
        except asyncio.CancelledError:
            if not self.gone:
                raise
        except Exception:  # pragma: no cover - a bug; keep serving others
            log.exception("connection failed")
        finally:
            self._cancel_timer()
            self._watching = False
            try:
                if self.phase is Phase.REFUSED:
                    await self._linger_then_close()
                self.abort() if self.gone else self.close()
            finally:
                if self._on_end is not None:
                    self._on_end(self)
        await closed(self.writer)

    async def _linger_then_close(self) -> None:
        """After refusing a request, read and drop what the client still sends.

        Closing a socket with unread input makes the kernel send a reset, which
        can reach the client before our 413 or 400 and hide it. So the write
        side is shut (the client sees the end of the response), and input is
        drained for a bounded time before the close (as Apache's lingering
        close does).
        """
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
            drained = 0
            async with deadline(LINGER_SECONDS):
                while drained < LINGER_BYTES:
                    data = await self._read()
                    if not data:
                        break
                    drained += len(data)
        except (TimeoutError, ConnectionError, OSError, RuntimeError):
            pass

    async def _receive_request(self) -> ClientRequest | None:
        """The next request, head checked and body read; None once refused or closed."""
        conn = self.h11
        leftover, closed = conn.trailing_data
        self._head_bytes = len(leftover)
        self._head_reads = [leftover]
        try:
            event = await self._next_event(buffered=bool(leftover) or closed)
            head_reads, self._head_reads = self._head_reads, None
            if isinstance(event, h11.ConnectionClosed):
                return None
            assert isinstance(event, h11.Request), event
            # h11 parses a head that arrived whole whatever its size; its own
            # limit only bounds a head still incomplete. Measure what it consumed.
            head_size = self._head_bytes - len(conn.trailing_data[0])
            # The names lowercased as h11's Headers yields them, without its
            # per-item Sequence iteration (raw_items() is one list comprehension).
            headers = [(name if name.islower() else name.lower(), value)
                       for name, value in event.headers.raw_items()]
            refused = refusal(event, head_reads or [b""], head_size, self.limits, headers)
            if refused is not None:
                status, message, kind, *extra = refused
                await self._reject(status, message, kind, extra[0] if extra else None,
                                   target=event.target)
                return None
            if conn.client_is_waiting_for_100_continue:
                self.write(conn.send(h11.InformationalResponse(
                    status_code=100, headers=[], reason=b"Continue")))
                await self.drain()
            body = await self._receive_body(event.target)
        except h11.RemoteProtocolError as exc:
            await self._reject_unparsable(exc)
            return None
        if body is None:
            return None
        self._disarm()
        return ClientRequest(event.method, origin_target(event.target), headers,
                             body, event.http_version, self.watch_client)

    async def _reject_unparsable(self, exc: h11.RemoteProtocolError) -> None:
        status = exc.error_status_hint
        if status >= 500:
            # h11 hints 501 for a transfer coding other than chunked (RFC 9112
            # 6.1). The request cannot be framed, which is the client's fault:
            # nothing a client sends may earn a 5xx other than 505.
            status = 400
        if status == 431 and self._head_reads is not None \
                and oversized_head_status(self._head_reads, self.limits) == 414:
            # h11 folds the request line into its head limit: a long target is a 414.
            await self._reject(414, "request target too long", "uri_too_long")
        elif status == 431:
            await self._reject(431, "request header fields too large", "header_too_large")
        else:
            # h11's words without the client's bytes they quote (a header an
            # ingress added may hold a secret; logs see this text too).
            complaint = without_quoted_bytes(str(exc), "unreadable")
            await self._reject(status, f"malformed request: {complaint}", "bad_request")

    async def _receive_body(self, target: bytes) -> bytes | None:
        """The whole body, bounded; None once refused (413) or the client left."""
        limits = self.limits
        self._enter(Phase.BODY, limits.header_timeout)
        self._body_until = self._loop.time() + limits.header_timeout
        parts: list[bytes] = []
        size = 0
        # Pieces are bounded (CHUNK_COST), not only bytes: a
        # body sent in one-byte chunks cost ~170 bytes of memory and microseconds
        # of h11 per byte, so 32 MiB of them took gigabytes and minutes of one
        # loop. Real clients' chunks are kilobytes, far inside the bound.
        pieces_left = limits.max_body_bytes // CHUNK_COST
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                size += len(event.data)
                pieces_left -= 1
                if size > limits.max_body_bytes or pieces_left < 0:
                    await self._reject(413, "request body too large" if pieces_left >= 0
                                       else "request body in too many chunks",
                                       "request_too_large", target=target)
                    return None
                parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                # h11 hands out bytearrays; a body is immutable bytes from here on
                # (httpcore sends only bytes: a GET's body is forwarded as is).
                return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
            else:  # ConnectionClosed mid-body
                return None

    async def _respond(self, request: ClientRequest) -> bool:
        """Run the handler; True when the connection can serve another request."""
        conn = self.h11
        responder = Responder(self, head=request.method == b"HEAD")
        self._enter(Phase.HANDLING)
        # No deadline while a handler runs (a generation may be long): the handle
        # goes now, not at its time, so that a long stream holds no timer (the
        # next phase arms one, far enough ahead that the phases after it find
        # it in time).
        self._cancel_timer()
        try:
            await self.handler(request, responder)
        except ClientGone:
            raise
        except AbortResponse:
            # The handler logged why; a started response is cut, never completed.
            if responder.started:
                responder.flush()
            else:
                await responder.send_bytes(502, bad_gateway(speaks_anthropic(request.path)))
            return False
        except Exception:
            log.exception("handler failed on %s %s", request.method.decode(), request.path)
            if responder.started:
                return False
            await responder.send_bytes(500, internal_error(speaks_anthropic(request.path)))
        finally:
            self._watching = False
            if self.phase is Phase.HANDLING:
                self.phase = Phase.IDLE  # the loop arms the idle timer next
        if not responder.ended:
            return False
        if self.phase in _FINAL or conn.our_state is not h11.DONE \
                or conn.their_state is not h11.DONE:
            return False
        return True

    async def _reject(self, status: int, message: str, kind: str,
                      headers: Headers | None = None, target: bytes = b"") -> None:
        """Answer a request we will not serve, then the connection closes.

        The target, once its head is read, picks the surface's error shape."""
        anthropic = speaks_anthropic(target.split(b"?", 1)[0].decode("latin-1"))
        body = error_body(status, message, kind, anthropic=anthropic)
        extra = b"".join(name + b": " + value + b"\r\n" for name, value in headers or ())
        data = canned_response(status, body, extra)
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                response = h11.Response(status_code=status, reason=REASONS.get(status, b""),
                                        headers=[(b"content-type", b"application/json"),
                                                 (b"content-length", str(len(body)).encode()),
                                                 (b"connection", b"close"),
                                                 *(headers or ())])
                data = self.h11.send(response) + self.h11.send(h11.Data(data=body))
                data += self.h11.send(END_OF_MESSAGE)
            except h11.LocalProtocolError:
                data = canned_response(status, body, extra)
        try:
            self.write(data)
            await self.drain()
        except ClientGone:
            return
        self._enter(Phase.REFUSED)
