"""The one place a leg's Failure becomes a metric, a log line and the client's answer.

Two phases: before the response has started the client gets a status and a JSON
body in its surface's shape; after, the response is cut (AbortResponse), never
completed, so a truncated answer does not look whole.
"""

from __future__ import annotations

import logging

from .. import answers
from ..config.settings import Config
from ..downstream.messages import AbortResponse, ResponseWriter
from ..observability import logs
from ..observability.metrics import Metrics
from ..routes import speaks_anthropic
from ..upstream.errors import UpstreamTimeout, UpstreamUnreachable
from .exchange import Exchange
from .failures import (
    DecodeFailed,
    DecodeTimedOut,
    Failure,
    NoDecode,
    PrefillFailed,
    PrefillRefused,
    Truncated,
)

log = logging.getLogger("lowproxy.dispatch")  # the dispatcher's lines


async def answer_failure(config: Config, metrics: Metrics, exchange: Exchange,
                         responder: ResponseWriter, failure: Failure) -> None:
    """Count, log and answer one failure; cut the response if it had started."""
    request_id = exchange.request_id
    anthropic = speaks_anthropic(exchange.request.path)  # the surface's error shape
    if isinstance(failure, NoDecode):
        metrics.decode_legs.inc("unreachable")
        logs.warn(log, f"no decode backend: {failure.detail}", request_id)
        status, body = config.no_decode_status, answers.no_decode_backend(
            config.no_decode_message)
    elif isinstance(failure, DecodeFailed):
        error = failure.error
        timed_out = isinstance(error, UpstreamTimeout)  # its head did not come in time
        metrics.decode_legs.inc("unreachable" if isinstance(error, UpstreamUnreachable)
                                else "timeout" if timed_out else "error")
        logs.warn(log, f"decode backend failed before answering ({error.reason}): "
                  f"{error.detail}", request_id,
                  backend=error.endpoint.label if error.endpoint else None)
        # A timeout says so: "failed" would send the operator looking for a crash.
        status = 504 if timed_out else 502
        body = answers.decode_timed_out(anthropic) if timed_out else \
            answers.decode_failed(status, anthropic)
    elif isinstance(failure, DecodeTimedOut):
        metrics.decode_legs.inc("timeout")
        logs.warn(log, f"decode did not finish within {config.decode_timeout:g}s",
                  request_id, backend=exchange.decode_backend)
        status, body = 504, answers.decode_timed_out(anthropic)
    elif isinstance(failure, PrefillRefused):
        logs.warn(log, f"{failure}: its answer is relayed, decode is not asked",
                  request_id, backend=exchange.prefill_backend)
        status = failure.status
        body = failure.body or answers.prefill_refused(status, anthropic)
    elif isinstance(failure, PrefillFailed):
        # Counted and logged where the prefill leg failed.
        status, body = 502, answers.prefill_failed(failure.detail, anthropic)
    elif isinstance(failure, Truncated):
        metrics.decode_legs.inc("truncated")
        if responder.started:
            logs.warn(log, f"decode broke off its response after {responder.bytes_out} "
                      f"bytes; the client's response is cut: {failure.detail}", request_id,
                      backend=failure.backend)
            raise AbortResponse()
        # Read whole before any of it went out (its usage rewritten): the client
        # is owed a status, and the access line and metrics say the same one.
        logs.warn(log, f"decode broke off its response before any of it was sent; the "
                  f"client gets 502: {failure.detail}", request_id, backend=failure.backend)
        status, body = 502, answers.decode_failed(502, anthropic)
    else:  # pragma: no cover - every Failure is listed above
        raise failure
    if responder.started:
        raise AbortResponse()  # a started response is cut, never completed
    await responder.send_bytes(status, body)
