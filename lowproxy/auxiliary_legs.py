"""The legs whose answers no client sees: the prefill leg and SGLang's aborts.

Each sends one request and reads its answer to a bounded outcome; what the
outcome means for the client (metrics, logs, the failure policy) is decided by
dispatch.py. Also here: closing a decode leg that will not be relayed.
"""

from __future__ import annotations

import asyncio

from .answers import json_body
from .backend_json import MAX_PREFILL_ANSWER_BYTES
from .failures import PrefillResult, prefill_outcome
from .messages import Headers
from .timeouts import deadline
from .upstream import Endpoint, Upstream, UpstreamError, UpstreamResponse

# SGLang's POST /abort_request: best effort, and never waited on by a client.
ABORT_TIMEOUT_SECONDS = 2.0
ABORT_HEADERS = [(b"content-type", b"application/json")]


async def send_prefill_leg(upstream: Upstream, endpoint: Endpoint, target: bytes,
                           headers: Headers, body: bytes, extra_headers: Headers,
                           want_kv: bool, timeout: float,
                           surface: str | None = None) -> tuple[PrefillResult, int | None]:
    """One prefill leg and what its answer means; never raises for a backend failure.

    The outcome ``unreachable`` (nothing was sent) lets the caller cool the
    endpoint down; the status is the prefill's, when it answered.
    """
    status = None
    try:
        async with deadline(timeout):
            response = await upstream.request(endpoint, b"POST", target, headers, body,
                                              extra_headers=extra_headers)
            status = response.status
            try:
                raw = await response.read(MAX_PREFILL_ANSWER_BYTES)
            finally:
                await response.aclose()
        return prefill_outcome(response.status, raw, want_kv, surface), status
    except TimeoutError:
        return PrefillResult(False, "timeout",
                             detail=f"prefill did not answer within {timeout:g}s"), status
    except UpstreamError as exc:
        outcome = {"unreachable": "unreachable", "timeout": "timeout"}.get(exc.reason, "error")
        return PrefillResult(False, outcome, detail=exc.detail), status


async def send_abort(upstream: Upstream, endpoint: Endpoint, rid: str) -> int:
    """``POST /abort_request {"rid": rid}`` (SGLang aborts every rid with that prefix)."""
    async with deadline(ABORT_TIMEOUT_SECONDS):
        response = await upstream.request(endpoint, b"POST", b"/abort_request",
                                          ABORT_HEADERS, json_body({"rid": rid}))
        try:
            await response.read(64 * 1024)
        finally:
            await response.aclose()
    return response.status


def drop_decode(task: asyncio.Task[UpstreamResponse]) -> None:
    """Close a decode leg that will not be relayed, however far it got."""
    if not task.done():
        task.cancel()  # its connection is discarded: decode sees the drop and aborts
        task.add_done_callback(_close_late)
        return
    _close_late(task)


def _close_late(task: asyncio.Task[UpstreamResponse]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    task.result().abandon()
