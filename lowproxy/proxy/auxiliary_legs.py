"""The legs whose answers no client sees: the prefill leg and SGLang's aborts.

Each sends one request and reads its answer to a bounded outcome; what the
outcome means for the client (metrics, logs, the failure policy) is decided by
dispatch.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

from .._types import Headers
from ..answers import json_body
from ..handshakes.backend_json import MAX_PREFILL_ANSWER_BYTES
from ..observability import logs
from ..timeouts import Deadlines, deadline
from ..upstream.endpoint import Endpoint
from ..upstream.errors import UpstreamTimeout, UpstreamUnreachable
from ..upstream.pool import Upstream, UpstreamError
from .failures import PrefillResult, prefill_outcome

# SGLang's POST /abort_request: best effort, and never waited on by a client.
ABORT_TIMEOUT_SECONDS = 2.0
ABORT_HEADERS = [(b"content-type", b"application/json")]
MAX_ABORTED_RIDS = 256  # a batch's children, aborted one by one
# A prefill answer is read to its end up to this (its first 8 MiB kept): more is
# no answer but a backend gone wrong, and the leg fails.
MAX_PREFILL_DRAINED_BYTES = 256 * 1024 * 1024

log = logging.getLogger("lowproxy.dispatch")


async def send_prefill_leg(upstream: Upstream, endpoint: Endpoint, target: bytes,
                           headers: Headers, body: bytes, extra_headers: Headers,
                           want_kv: bool, timeout: float, deadlines: Deadlines,
                           surface: str | None = None,
                           on_load: Callable[[bytes | None], None] | None = None,
                           while_waiting: Callable[[], None] | None = None,
                           finish: str | None = None, logprobs: bool = False,
                           ) -> tuple[PrefillResult, int | None]:
    """One prefill leg and what its answer means; never raises for a backend failure.

    The outcome ``unreachable`` (nothing was sent) lets the caller cool the
    endpoint down; the status is the prefill's, when it answered.
    """
    status = None
    if any(name == b"accept-encoding" for name, _ in headers):
        # Prefill's answer is lowproxy's own to read (its kv_transfer_params, its
        # usage, its refusal): a compressing hop must not encode it for the client.
        headers = [header for header in headers if header[0] != b"accept-encoding"]
    try:
        with deadlines.within(timeout):
            response = await upstream.request(endpoint, b"POST", target, headers, body,
                                              extra_headers=extra_headers,
                                              while_waiting=while_waiting)
            status = response.status
            if on_load is not None:  # the ORCA load report (engine_load.py), if any
                on_load(next((value for name, value in response.headers
                              if name.lower() == b"endpoint-load-metrics"), None))
            try:
                # Beyond the bound (prompt logprobs of a long prompt) the answer is
                # cut, not failed: what matters of it (kv_transfer_params, usage) is
                # then unreadable and handled as such, but the KV is there, and
                # under sglang, where nothing of it is read, the request goes on.
                raw = await response.read_prefix(MAX_PREFILL_ANSWER_BYTES,
                                                 MAX_PREFILL_DRAINED_BYTES)
            finally:
                await response.aclose()
        return prefill_outcome(response.status, raw, want_kv, surface, finish,
                               logprobs), status
    except TimeoutError:
        return PrefillResult(False, "timeout",
                             detail=f"prefill did not answer within {timeout:g}s"), status
    except UpstreamError as exc:
        outcome = ("unreachable" if isinstance(exc, UpstreamUnreachable)
                   else "timeout" if isinstance(exc, UpstreamTimeout) else "error")
        return PrefillResult(False, outcome, detail=exc.detail), status


async def send_abort(upstream: Upstream, endpoint: Endpoint, rids: tuple[str, ...], role: str,
                     request_id: str, leg_headers: Headers | None = None) -> None:
    """``POST /abort_request {"rid": rid}`` for each rid the leg is served under.

    SGLang (one tokenizer worker) aborts the exact rid only, and a batch's
    children run as ``<rid>_<i>``: each is aborted by name, at most
    MAX_ABORTED_RIDS (the rest are left to SGLang noticing the closed
    connection). The ``authorization`` of ``leg_headers`` goes along: the
    backend key, or the client's with PD_PROXY_FORWARD_AUTHORIZATION, as
    SGLang's --api-key guards this path too, or PD_PROXY_SGLANG_ADMIN_API_KEY,
    the only key it takes once SGLang has an --admin-api-key. Best effort and
    bounded: the outcome is logged, never raised; the first failure ends the
    round (the backend is gone).
    """
    headers = [*ABORT_HEADERS, *(h for h in leg_headers or () if h[0] == b"authorization")]
    statuses: list[int] = []
    for rid in rids[:MAX_ABORTED_RIDS]:
        try:
            async with deadline(ABORT_TIMEOUT_SECONDS):
                response = await upstream.request(endpoint, b"POST", b"/abort_request",
                                                  headers, json_body({"rid": rid}))
                try:
                    await response.read(64 * 1024)
                finally:
                    await response.aclose()
        except (TimeoutError, UpstreamError) as exc:
            logs.warn(log, f"abort of {role} leg {rid} failed: {exc or 'timed out'}",
                      request_id, backend=endpoint.label)
            return
        statuses.append(response.status)
    refused = [status for status in statuses if not 200 <= status < 300]
    if refused:  # 401: the backend key (PD_PROXY_BACKEND_API_KEY) is missing or wrong
        logs.warn(log, f"abort of {role} leg {rids[0]} refused ({refused[0]})", request_id,
                  backend=endpoint.label)
        return
    log.info("aborted %s leg %s (%d rids)", role, rids[0], len(statuses),
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
