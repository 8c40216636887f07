"""Optional OpenTelemetry spans, with the llm-d PD proxy's attribute names.

Enabled by PD_PROXY_OTEL=1 when ``opentelemetry-api`` is importable (spans go
wherever the process's tracer provider sends them). Disabled, the proxy holds
``None`` instead of a Tracing and the request path pays one ``is None`` test.

A request gets a server span (its parent taken from the client's W3C
``traceparent``), with a prefill and a decode child span; the traceparent sent
upstream is the server span's, so backend spans nest under it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..headers import connection_tokens

try:  # optional: spans only when opentelemetry-api is installed
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    OTEL_INSTALLED = True
except ImportError:
    OTEL_INSTALLED = False

log = logging.getLogger("lowproxy.tracing")

PREFIX = "llm_d.pd_proxy"


def trace_context(request: Any, upstream_headers: list[tuple[bytes, bytes]],
                  start_traces: bool, tracing: Tracing | None) -> tuple[str | None, Any]:
    """W3C trace context for both legs: the trace id to log, and the server span if any.

    The client's traceparent/tracestate reach both legs (the server span's own
    traceparent when spans are on); PD_PROXY_TRACE=1 starts a trace for a
    request that carries none. Appends to ``upstream_headers``. Trace headers
    the client's Connection names are hop-by-hop (RFC 9110 7.6.1): they
    neither cross nor parent a span, as if the client had sent none.
    """
    traceparent = request.header(b"traceparent")
    tracestate = request.header(b"tracestate")
    if (traceparent is not None or tracestate is not None) \
            and request.header(b"connection") is not None:
        named = connection_tokens(request.headers)
        if b"traceparent" in named:
            traceparent = None
        if b"tracestate" in named:
            tracestate = None
    trace_id = None
    span = None
    if tracing is not None:
        span = tracing.server_span(traceparent, tracestate, request.method.decode("latin-1"),
                                   request.path, time.time_ns())
        traceparent, trace_id = tracing.traceparent_of(span)
    elif traceparent is not None:
        parts = traceparent.split(b"-")
        if len(parts) >= 4:
            trace_id = parts[1].decode("latin-1")
    elif start_traces:
        trace_id = os.urandom(16).hex()
        traceparent = f"00-{trace_id}-{os.urandom(8).hex()}-01".encode()
    if traceparent is not None:
        upstream_headers.append((b"traceparent", traceparent))
        if tracestate is not None:
            upstream_headers.append((b"tracestate", tracestate))
    return trace_id, span


class Tracing:
    def __init__(self) -> None:
        if not OTEL_INSTALLED:
            raise ImportError("opentelemetry-api is not installed")
        self._trace = otel_trace
        self._tracer = otel_trace.get_tracer("lowproxy")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def create(cls, enabled: bool) -> Tracing | None:
        if not enabled:
            return None
        try:
            return cls()
        except ImportError:
            log.warning("PD_PROXY_OTEL=1 but opentelemetry-api is not installed: no spans")
            return None

    def server_span(self, traceparent: bytes | None, tracestate: bytes | None,
                    method: str, path: str, start_ns: int) -> Any:
        carrier = {}
        if traceparent is not None:
            carrier["traceparent"] = traceparent.decode("latin-1")
            if tracestate is not None:
                carrier["tracestate"] = tracestate.decode("latin-1")
        parent = self._propagator.extract(carrier) if carrier else None
        return self._tracer.start_span(
            f"{method} {path}", context=parent, kind=self._trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
            start_time=start_ns)

    def traceparent_of(self, span: Any) -> tuple[bytes, str]:
        """The W3C traceparent to send upstream, and the trace id for the access log."""
        context = span.get_span_context()
        trace_id = format(context.trace_id, "032x")
        header = f"00-{trace_id}-{format(context.span_id, '016x')}-" \
                 f"{int(context.trace_flags):02x}"
        return header.encode(), trace_id

    def record_prefill(self, exchange: Any, target: str, started: float, status: int | None,
                       ok: bool, concurrent: bool) -> None:
        """The prefill child span, written when the leg has ended."""
        now = time.perf_counter()
        span = self._child(exchange, "prefill", started, {
            f"{PREFIX}.prefill_target": target,
            f"{PREFIX}.connector": exchange.handshake or "relay",
            f"{PREFIX}.prefill.async": concurrent,
            f"{PREFIX}.prefill.duration_ms": (now - started) * 1000.0,
        })
        if status is not None:
            span.set_attribute(f"{PREFIX}.prefill.status_code", status)
        if not ok:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR,
                                               "prefill request failed"))
        span.end(end_time=_epoch_ns(exchange, now))

    def end_request(self, exchange: Any, status: int, concurrent: bool) -> None:
        now = time.perf_counter()
        span = exchange.span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute(f"{PREFIX}.total_duration_ms", (now - exchange.started) * 1000.0)
        if exchange.decode_started is not None:
            decode_ms = (now - exchange.decode_started) * 1000.0
            decode = self._child(exchange, "decode", exchange.decode_started, {
                f"{PREFIX}.connector": exchange.handshake or "passthrough",
                f"{PREFIX}.decode.concurrent_with_prefill": concurrent,
                f"{PREFIX}.decode.duration_ms": decode_ms,
                f"{PREFIX}.decode.target": exchange.decode_backend or "",
            })
            decode.end(end_time=_epoch_ns(exchange, now))
            # llm-d's "true TTFT": from the request's arrival to the decode leg's start.
            span.set_attribute(f"{PREFIX}.true_ttft_ms",
                               (exchange.decode_started - exchange.started) * 1000.0)
            span.set_attribute(f"{PREFIX}.decode_duration_ms", decode_ms)
        span.set_attribute(f"{PREFIX}.concurrent_pd", concurrent)
        if status >= 500:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        span.end(end_time=_epoch_ns(exchange, now))

    def _child(self, exchange: Any, name: str, started: float,
               attributes: dict[str, Any]) -> Any:
        context = self._trace.set_span_in_context(exchange.span)
        return self._tracer.start_span(f"{PREFIX}.{name}", context=context,
                                       kind=self._trace.SpanKind.INTERNAL,
                                       attributes=attributes,
                                       start_time=_epoch_ns(exchange, started))


def _epoch_ns(exchange: Any, perf: float) -> int:
    """A perf_counter instant of this exchange as epoch nanoseconds, for span times."""
    return exchange.started_ns + int((perf - exchange.started) * 1e9)
