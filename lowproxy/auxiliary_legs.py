"""The legs whose answers no client sees: the prefill leg and SGLang's aborts.

Each sends one request and reads its answer to a bounded outcome; what the
outcome means for the client (metrics, logs, the failure policy) is decided by
dispatch.py. Also here: closing a decode leg that will not be relayed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

from . import logs
from .answers import json_body
from .backend_json import MAX_PREFILL_ANSWER_BYTES
from .failures import PrefillResult, prefill_outcome
from .messages import Headers
from .timeouts import deadline
from .upstream import Endpoint, Upstream, UpstreamError, UpstreamResponse

# SGLang's POST /abort_request: best effort, and never waited on by a client.
ABORT_TIMEOUT_SECONDS = 2.0
ABORT_HEADERS = [(b"content-type", b"application/json")]

log = logging.getLogger("lowproxy.exchange")


async def send_prefill_leg(upstream: Upstream, endpoint: Endpoint, target: bytes,
                           headers: Headers, body: bytes, extra_headers: Headers,
                           want_kv: bool, timeout: float,
                           surface: str | None = None,
                           on_load: Callable[[bytes | None], None] | None = None,
                           ) -> tuple[PrefillResult, int | None]:
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
            if on_load is not None:  # the ORCA load report (engine_load.py), if any
                on_load(next((value for name, value in response.headers
                              if name.lower() == b"endpoint-load-metrics"), None))
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


async def send_abort(upstream: Upstream, endpoint: Endpoint, rid: str, role: str,
                     request_id: str) -> None:
    """``POST /abort_request {"rid": rid}`` (SGLang aborts every rid with that prefix).

    Best effort and bounded: the outcome is logged, never raised.
    """
    try:
        async with deadline(ABORT_TIMEOUT_SECONDS):
            response = await upstream.request(endpoint, b"POST", b"/abort_request",
                                              ABORT_HEADERS, json_body({"rid": rid}))
            try:
                await response.read(64 * 1024)
            finally:
                await response.aclose()
    except (TimeoutError, UpstreamError) as exc:
        logs.warn(log, f"abort of {role} leg {rid} failed: {exc or 'timed out'}",
                  request_id, backend=endpoint.label)
        return
    log.info("aborted %s leg %s (%d)", role, rid, response.status,
             extra={"fields": {"request_id": request_id, "backend": endpoint.label}})


class BackgroundTasks:
    """Tasks that outlive their request (a prefill leg left to finish, an abort)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        # Cached: asyncio.get_running_loop() costs a getpid() syscall on 3.11.
        self.loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self.tasks)

    def running_loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        return self.loop

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self.running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def close(self, grace: float = 0.0) -> None:
        """Running tasks get ``grace`` seconds, then are cancelled."""
        if self.tasks and grace > 0:
            await asyncio.wait(list(self.tasks), timeout=grace)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)


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
