"""Decode's answer to the client: relayed as it arrives, or read whole when its usage is rewritten.

dispatch.py opens decode's response; this copies it, inside the decode timeout
dispatch sets, and raises Truncated when decode breaks off.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .._types import Headers
from ..downstream.messages import ClientGone, ResponseWriter
from ..handshakes.sglang_logprobs import EncodedPrefix, merge_body, merge_some_events
from ..handshakes.usage import carries_usage, rewrite_body, rewrite_events
from ..headers import client_response_head
from ..observability.metrics import Histogram, Metrics
from ..upstream.pool import UpstreamError, UpstreamResponse
from .exchange import Exchange
from .failures import Truncated

# A non-streamed answer whose usage is rewritten is read whole; larger is cut.
MAX_REWRITTEN_BYTES = 64 * 1024 * 1024
# ...but only SGLang's logprobs merge needs it that big: a usage figure is not
# worth holding more than this per request (60 MB answers, a few at once, took
# the process past a gigabyte), so a larger answer goes on as decode sent it.
MAX_USAGE_REWRITE_BYTES = 1024 * 1024
# A streamed answer whose usage is rewritten goes on in whole lines (an event's
# data line cut by a read would escape the rewrite); a line longer than this
# goes on as it comes, unrewritten, rather than be held without bound.
MAX_HELD_LINE_BYTES = 4 * 1024 * 1024
# SGLang's prompt logprobs go into every streamed event: at most this much merged
# output is made before the client has taken what went before.
MERGE_BUDGET_BYTES = 1024 * 1024
_LINE_ENDS = (b"\n", b"\r")  # an SSE line ends with either (CRLF: the LF)


async def relay(metrics: Metrics, exchange: Exchange, responder: ResponseWriter,
                response: UpstreamResponse) -> None:
    """Decode's status, headers and body to the client, as each read arrives.

    The body is never decompressed or re-parsed; what one read from decode
    brought goes out in one write, and a slow client makes the relay stop
    reading from decode (back-pressure).
    """
    # A stream's success is labelled an event stream whatever decode said (as the
    # GCO proxy does); its refusal keeps decode's own type: a JSON error labelled
    # text/event-stream is an empty stream to SSE clients and unreadable to others.
    headers, content_length = client_response_head(
        response.headers, exchange.wants_stream and 200 <= response.status < 300)
    cached = exchange.prefill_cached_tokens
    surface = exchange.surface
    logprobs = exchange.prefill_input_logprobs  # SGLang's prompt logprobs, to merge
    if (cached is not None or logprobs is not None) and surface is not None \
            and 200 <= response.status < 300:
        # The prefill's cached-token figure goes into decode's usage.
        if content_length is not None and (logprobs is not None
                                           or content_length <= MAX_USAGE_REWRITE_BYTES):
            await _relay_rewritten(metrics, exchange, responder, response, headers, surface,
                                  cached or 0, logprobs)
            return
        if content_length is not None:  # too big to hold for a usage figure: as it came
            surface = None
    else:
        surface = None
    await responder.start(response.status, headers, content_length)
    del headers
    response.headers = []  # relayed: a stream that lasts minutes keeps no copy
    delivery = _Delivery(exchange, responder, metrics.decode_first_byte, surface, cached or 0,
                         None if logprobs is None else EncodedPrefix(logprobs))
    try:
        await response.deliver_body(delivery.deliver, delivery.wait if logprobs is not None
                                    else responder.wait_for_client)
    except UpstreamError as exc:
        with contextlib.suppress(ClientGone):  # the break-off is what is told, not that
            await delivery.merge_pending()
            delivery.release()  # decode's bytes, all of them, up to where it broke off
        raise Truncated(exc.detail, response.endpoint.label) from None
    delivery.first_byte()
    await delivery.merge_pending()
    delivery.release()
    await responder.end()
    metrics.decode_legs.inc("ok")


class _Delivery:
    """Each read of decode's body to the client (the first one timed); usage rewritten
    in the events that carry it when ``surface`` is set.

    With ``surface`` set, what follows a read's last newline is held until the
    line ends: a usage event's data line cut across two reads (TCP segments,
    TLS records: routine on a real network) would otherwise reach the client
    with decode's figure. vLLM writes whole events, so its reads end on a
    newline and nothing is held; an SSE client can use no partial line anyway.

    An object with slots rather than a closure: a stream holds it for its whole
    life, and five cells, a tuple and a function cost three times its size.
    """

    __slots__ = ("exchange", "responder", "histogram", "surface", "cached", "logprobs", "held",
                 "held_bytes", "pending")

    def __init__(self, exchange: Exchange, responder: ResponseWriter, histogram: Histogram,
                 surface: str | None, cached: int, logprobs: EncodedPrefix | None = None
                 ) -> None:
        self.exchange = exchange
        self.responder = responder
        self.histogram = histogram
        self.surface = surface
        self.cached = cached
        self.logprobs = logprobs  # SGLang's prompt logprobs: merged instead of usage
        # A line begun in earlier reads (surface set only), in the pieces it came
        # in: joined once its newline comes, so a long line costs no quadratic copy.
        self.held: list[bytes] = []
        self.held_bytes = 0
        self.pending: list[bytes] = []  # whole lines whose logprobs are not merged yet

    def first_byte(self) -> None:
        exchange = self.exchange
        if exchange.first_byte_ms is None:
            exchange.first_byte_ms = exchange.elapsed_ms()
            self.histogram.observe(exchange.first_byte_ms / 1000.0)

    def deliver(self, pieces: list[bytes]) -> bool:
        if self.exchange.first_byte_ms is None:
            self.first_byte()
        surface = self.surface
        if surface is not None:
            # One read may bring several chunks: any of them may end mid-line.
            if self.held or len(pieces) != 1 or not pieces[0].endswith(_LINE_ENDS):
                pieces = self._whole_lines(pieces)
                if not pieces:
                    return False  # nothing to write yet: the client is not slow
            if self.logprobs is not None:
                return self._merge(pieces)
            if carries_usage(surface, pieces):
                pieces = [rewrite_events(surface, piece, self.cached) for piece in pieces]
        return self.responder.relay(pieces)

    def _merge(self, pieces: list[bytes]) -> bool:
        """SGLang's logprobs merged into whole lines, a budget at a time: what is left
        waits (reading from decode paused) until the client has taken the rest."""
        if self.pending:
            self.pending.extend(pieces)
            return True
        merged, rest = merge_some_events(b"".join(pieces), self.logprobs,  # type: ignore[arg-type]
                                         MERGE_BUDGET_BYTES)
        slow = self.responder.relay([merged])
        if rest:
            self.pending.append(rest)
            return True
        return slow

    async def wait(self) -> None:
        """Reading from decode resumes once the client took what went and what waited."""
        await self.responder.wait_for_client()
        await self.merge_pending()

    async def merge_pending(self) -> None:
        while self.pending:
            data, self.pending = b"".join(self.pending), []
            merged, rest = merge_some_events(data, self.logprobs,  # type: ignore[arg-type]
                                             MERGE_BUDGET_BYTES)
            if rest:
                self.pending.append(rest)
            if self.responder.relay([merged]) or self.pending:
                await self.responder.wait_for_client()

    def _whole_lines(self, pieces: list[bytes]) -> list[bytes]:
        """The bytes up to the last newline, what follows held for the next read."""
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1  # SSE also ends lines by CR
        held = self.held
        if cut == 0:  # still within one line
            held.append(data)
            self.held_bytes += len(data)
            if self.held_bytes <= MAX_HELD_LINE_BYTES:
                return []
            cut = len(data)  # a line beyond the bound: on as it is
            held.pop()
        whole = b"".join((*held, data[:cut])) if held else data[:cut]
        rest = data[cut:]
        self.held, self.held_bytes = ([rest], len(rest)) if rest else ([], 0)
        return [whole]

    def release(self) -> None:
        """What is held goes out as it is: decode's answer ended (or broke off) there."""
        held, self.held, self.held_bytes = self.held, [], 0
        if held:
            self.responder.relay([b"".join(held)])


async def _relay_rewritten(metrics: Metrics, exchange: Exchange, responder: ResponseWriter,
                           response: UpstreamResponse, headers: Headers, surface: str,
                           cached: int, logprobs: list[Any] | None = None) -> None:
    """A length-framed answer, read whole, its usage rewritten, its length recomputed."""
    try:
        raw = await response.read(MAX_REWRITTEN_BYTES)
    except UpstreamError as exc:
        raise Truncated(exc.detail, response.endpoint.label) from None
    exchange.first_byte_ms = exchange.elapsed_ms()
    metrics.decode_first_byte.observe(exchange.first_byte_ms / 1000.0)
    body = (merge_body(raw, logprobs) if logprobs is not None
            else rewrite_body(surface, raw, cached)) or raw
    await responder.start(response.status, headers, len(body))
    responder.buffer(body)  # head, body and end go out in one write
    await responder.end()
    metrics.decode_legs.inc("ok")
