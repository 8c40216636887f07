"""One client request's journey upstream: its context, the decode leg, the prefill leg.

The handshakes (handshakes/*.py) decide which bodies go where and when; the
functions here do the sending: pick a decode endpoint (failing over while
nothing was sent), relay decode's answer byte for byte, and run one prefill
leg to a bounded, logged outcome.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from . import logs
from .handshakes.legs import serialise
from .headers import client_response_head
from .messages import AbortResponse, ClientGone, ClientRequest, Responder, error_body
from .timeouts import deadline
from .upstream import Endpoint, UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    from .proxy import Proxy

log = logging.getLogger("lowproxy.exchange")

# A prefill answer is one token of JSON; anything this large is not one.
MAX_PREFILL_ANSWER_BYTES = 8 * 1024 * 1024


class NoDecodeBackend(Exception):
    """No decode endpoint could be reached (all refused, in cooldown, or untrusted)."""


class Exchange:
    """What every stage needs to know about one client request."""

    __slots__ = ("request", "responder", "request_id", "trace_id", "upstream_headers",
                 "started", "started_ns", "route", "handshake", "prefill_ms", "first_byte_ms",
                 "decode_backend", "prefill_backend", "wants_stream", "decode_started",
                 "span")

    def __init__(self, request: ClientRequest, responder: Responder, route: str,
                 request_id: str, upstream_headers: list[tuple[bytes, bytes]],
                 trace_id: str | None) -> None:
        self.request = request
        self.responder = responder
        self.route = route
        self.request_id = request_id
        self.trace_id = trace_id
        self.upstream_headers = upstream_headers
        self.started = time.perf_counter()
        self.started_ns = time.time_ns()
        self.decode_started: float | None = None
        self.span: Any = None  # the OpenTelemetry server span, when tracing is on
        self.handshake: str | None = None
        self.prefill_ms: float | None = None
        self.first_byte_ms: float | None = None
        self.decode_backend: str | None = None
        self.prefill_backend: str | None = None
        self.wants_stream = False

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0


# -- decode


async def open_decode(proxy: "Proxy", exchange: Exchange, method: bytes, target: bytes,
                      body: bytes | None) -> UpstreamResponse:
    """Send the decode leg; return once decode's response head has arrived.

    Endpoints that refuse the connection are cooled down and the next one is
    tried (nothing reached them, so nothing runs twice). Raise NoDecodeBackend
    when none is left, UpstreamError for a decode that failed after accepting.
    """
    if exchange.decode_started is None:
        exchange.decode_started = time.perf_counter()
    tried: tuple[Endpoint, ...] = ()
    last_error = "no decode backend configured"
    while True:
        endpoint = proxy.decode.pick_least_loaded(tried)
        if endpoint is None and not tried:
            endpoint = proxy.decode.soonest_usable()  # all cooling down: try one anyway
        if endpoint is None:
            raise NoDecodeBackend(last_error)
        try:
            response = await proxy.upstream.request(endpoint, method, target,
                                                    exchange.upstream_headers, body)
        except UpstreamError as exc:
            if exc.reason == "untrusted":
                raise NoDecodeBackend(exc.detail) from None
            if exc.reason != "unreachable":
                raise
            proxy.decode.cool_down(endpoint)
            logs.warn(log, f"decode backend unreachable: {exc.detail}", exchange.request_id,
                      backend=endpoint.label)
            last_error = exc.detail
            tried += (endpoint,)
            continue
        endpoint.cooldown_until = 0.0  # it answered: usable again (and ready)
        exchange.decode_backend = endpoint.label
        return response


async def relay_response(proxy: "Proxy", exchange: Exchange, response: UpstreamResponse) -> None:
    """Relay decode's status, headers and body to the client, chunk by chunk.

    The body is never decompressed or re-parsed. If decode breaks off after the
    response has started, the client's connection is closed without the final
    chunk (AbortResponse): a cut answer must not look complete.
    """
    responder = exchange.responder
    headers, content_length = client_response_head(response.headers, exchange.wants_stream)
    await responder.start(response.status, headers, content_length)
    metrics = proxy.metrics


    def deliver(pieces: list[bytes]) -> bool:
        # What one read from decode brought goes out in one write; a slow
        # client makes the relay stop reading from decode (back-pressure).
        if exchange.first_byte_ms is None:
            exchange.first_byte_ms = exchange.elapsed_ms()
            metrics.decode_first_byte.observe(exchange.first_byte_ms / 1000.0)
        for piece in pieces:
            responder.buffer(piece)
        responder.flush()
        return responder.client_is_slow

    try:
        await response.deliver_body(deliver, responder.wait_for_client)
    except UpstreamError as exc:
        metrics.decode_legs.inc("truncated")
        logs.warn(log, f"decode broke off its response after {responder.bytes_out} bytes; "
                  f"the client's response is cut: {exc.detail}", exchange.request_id,
                  backend=response.endpoint.label)
        raise AbortResponse() from None
    if exchange.first_byte_ms is None:
        exchange.first_byte_ms = exchange.elapsed_ms()
        metrics.decode_first_byte.observe(exchange.first_byte_ms / 1000.0)
    await responder.end()
    metrics.decode_legs.inc("ok")


async def send_decode(proxy: "Proxy", exchange: Exchange, method: bytes, target: bytes,
                      body: bytes | None) -> UpstreamResponse | None:
    """Open the decode leg; None when it failed and the client has been answered.

    The caller relays the response with relay_decode(). The two are separate so
    that whatever built the leg (the parsed body, the serialised legs) is gone
    before a stream that may last minutes starts.
    """
    try:
        async with decode_deadline(proxy, exchange):
            return await open_decode(proxy, exchange, method, target, body)
    except NoDecodeBackend as exc:
        await answer_no_decode(proxy, exchange, str(exc))
    except UpstreamError as exc:
        await answer_decode_failed(proxy, exchange, exc)
    except TimeoutError:
        await decode_timed_out(proxy, exchange)
    return None


def decode_deadline(proxy: "Proxy", exchange: Exchange) -> Any:
    """What is left of PD_PROXY_DECODE_TIMEOUT_SECONDS for this decode leg.

    No bound by default: a generation may stream for many minutes.
    """
    limit = proxy.config.decode_timeout
    if limit is None:
        return deadline(None)
    if exchange.decode_started is None:
        return deadline(limit)
    return deadline(max(0.0, limit - (time.perf_counter() - exchange.decode_started)))


async def decode_timed_out(proxy: "Proxy", exchange: Exchange) -> None:
    proxy.metrics.decode_legs.inc("timeout")
    logs.warn(log, f"decode did not finish within {proxy.config.decode_timeout:g}s",
              exchange.request_id, backend=exchange.decode_backend)
    if exchange.responder.started:
        raise AbortResponse()
    await exchange.responder.send_bytes(
        504, error_body(504, "decode backend timed out", "upstream_timeout"))


async def relay_decode(proxy: "Proxy", exchange: Exchange, response: UpstreamResponse) -> None:
    """Relay an opened decode response within the decode timeout; always close it."""
    try:
        async with decode_deadline(proxy, exchange):
            await relay_response(proxy, exchange, response)
    except TimeoutError:
        await decode_timed_out(proxy, exchange)
    except (asyncio.CancelledError, ClientGone) as exc:
        if isinstance(exc, ClientGone) or exchange.responder.client_gone:
            proxy.metrics.decode_legs.inc("client-gone")
        raise
    finally:
        await response.aclose()


async def answer_no_decode(proxy: "Proxy", exchange: Exchange, detail: str) -> None:
    proxy.metrics.decode_legs.inc("unreachable")
    logs.warn(log, f"no decode backend: {detail}", exchange.request_id)
    config = proxy.config
    await exchange.responder.send_json(
        config.no_decode_status,
        {"error": {"message": config.no_decode_message, "type": "no_decode_backend"}})


async def answer_decode_failed(proxy: "Proxy", exchange: Exchange, exc: UpstreamError) -> None:
    proxy.metrics.decode_legs.inc("unreachable" if exc.reason == "unreachable" else "error")
    logs.warn(log, f"decode backend failed before answering ({exc.reason}): {exc.detail}",
              exchange.request_id)
    status = 504 if exc.reason == "timeout" else 502
    await exchange.responder.send_bytes(
        status, error_body(status, "decode backend failed before answering", "upstream_error"))


# -- prefill


class PrefillResult:
    __slots__ = ("ok", "outcome", "kv_transfer_params", "detail")

    def __init__(self, ok: bool, outcome: str, kv_transfer_params: Any = None,
                 detail: str = "") -> None:
        self.ok = ok
        self.outcome = outcome  # ok, error, timeout
        self.kv_transfer_params = kv_transfer_params
        self.detail = detail


async def prefill_leg(proxy: "Proxy", exchange: Exchange, endpoint: Endpoint, target: bytes,
                      body: bytes, extra_headers: list[tuple[bytes, bytes]],
                      want_kv: bool) -> PrefillResult:
    """Send one prefill leg and read its answer; bounded by the prefill timeout.

    Never raises for a backend failure: the outcome says what happened and a
    warning names it, with the request id. A failure drops the endpoint's
    cached bootstrap map (a restarted prefill has new engine ids).
    """
    handshake = exchange.handshake or "relay"
    started = time.perf_counter()
    exchange.prefill_backend = endpoint.label
    result: PrefillResult
    status = None
    try:
        async with deadline(proxy.config.prefill_timeout):
            response = await proxy.upstream.request(endpoint, b"POST", target,
                                                    exchange.upstream_headers, body,
                                                    extra_headers=extra_headers)
            status = response.status
            try:
                raw = await response.read(MAX_PREFILL_ANSWER_BYTES)
            finally:
                await response.aclose()
        if not 200 <= response.status < 300:
            result = PrefillResult(False, "error",
                                   detail=f"prefill answered {response.status}")
        elif want_kv:
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = None
            kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            result = PrefillResult(True, "ok", kv)
        else:
            result = PrefillResult(True, "ok")
    except TimeoutError:
        result = PrefillResult(False, "timeout", detail="prefill did not answer within "
                               f"{proxy.config.prefill_timeout:g}s")
    except UpstreamError as exc:
        if exc.reason == "unreachable":
            proxy.prefill.cool_down(endpoint)
        result = PrefillResult(False, "timeout" if exc.reason == "timeout" else "error",
                               detail=exc.detail)
    elapsed = time.perf_counter() - started
    exchange.prefill_ms = elapsed * 1000.0
    proxy.metrics.prefill_duration.observe(elapsed, handshake)
    proxy.metrics.prefill_legs.inc(handshake, result.outcome)
    if exchange.span is not None:
        proxy.tracing.record_prefill(exchange, endpoint.label, started, status, result.ok,
                                     concurrent=not want_kv)
    if not result.ok:
        proxy.bootstrap.forget(endpoint)
        logs.warn(log, f"prefill leg failed ({result.outcome}): {result.detail}",
                  exchange.request_id, backend=endpoint.label, handshake=handshake)
    return result


async def answer_prefill_failed(proxy: "Proxy", exchange: Exchange, detail: str) -> None:
    """PD_PROXY_ON_PREFILL_FAILURE=error: the client is told, decode is not asked."""
    await exchange.responder.send_json(502, {"error": {
        "message": f"prefill failed: {detail}", "type": "prefill_failed", "code": 502}})


async def recompute(proxy: "Proxy", exchange: Exchange,
                    body: dict[str, Any]) -> UpstreamResponse | None:
    """Decode computes the prompt itself: the client's body, no kv_transfer_params."""
    proxy.metrics.prefill_legs.inc(exchange.handshake or "relay", "recompute")
    logs.warn(log, "decode will recompute the prompt without transferred KV",
              exchange.request_id, handshake=exchange.handshake)
    exchange.decode_started = None  # a new decode leg, with its own timeout
    return await send_decode(proxy, exchange, b"POST", exchange.request.target,
                             serialise(body))
