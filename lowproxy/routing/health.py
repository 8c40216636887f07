"""Active knowledge of the backends: health checks and model lists, per endpoint.

Every PD_PROXY_HEALTH_INTERVAL_SECONDS, each prefill and decode endpoint gets
``GET /health`` (vLLM: 200, or 503 once its engine is dead) and then
``GET /v1/models``, both with the backend key (vLLM's --api-key guards /v1)
and each bounded by PD_PROXY_HEALTH_TIMEOUT_SECONDS. Each endpoint is checked
in a task of its own, so one that hangs delays nobody else's check, and a new
check of an endpoint starts only once its last one has ended. What is learned
goes to the endpoint's BackendGroup (groups.py), which the picks read.

A model list comes from vLLM's ``{"data": [{"id", "max_model_len"}, ...]}``
(LoRA adapters are entries of their own). An endpoint that never answered one
(no /v1/models, an answer of another shape) has no known list, and lowproxy
then routes as if it knew none. A model that no decode lists is answered 404
only when every decode's list is known and a refresh begun after the model was
first asked for has not found it (an adapter may have just been loaded).

Under Mooncake a prefill check that fails, and the first that passes after one
failed, are told to the bootstrap cache (handshakes/bootstrap.py): either may be
a restart, after which the engine ids it answered before are wrong.

With the interval 0, lowproxy sends backends nothing of its own: no checks and
no model lists, so no 404/400 from model knowledge either.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, Callable, Iterable

from .. import answers
from ..config.settings import Config
from ..keys import BackendKey
from ..routes import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from ..timeouts import deadline
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Upstream, UpstreamError
from .groups import BackendGroup, parse_models

log = logging.getLogger("lowproxy.health")

HEALTH_TARGET = b"/health"
MODELS_TARGET = b"/v1/models"
MAX_ANSWER_BYTES = 4 * 1024 * 1024
MISSING_KEPT = 1024  # model names asked for and not found, remembered for their refresh
# Refreshes for models not found begin at most this often: a client naming a new
# unknown model in every request must not drive GET /v1/models at its own rate.
REFRESH_SPACING_SECONDS = 1.0
KEY_REFUSED = (401, 403)  # a backend's answer to a missing or wrong backend key
# The field that caps each surface's output, as vLLM reads it (build_tok_params).
# Chat: max_completion_tokens when set, else max_tokens (output_cap). The
# generate API has none at the top level (its cap is inside sampling_params, and
# vLLM checks no context length there).
CAP_FIELD = {COMPLETIONS: "max_tokens", RESPONSES: "max_output_tokens", MESSAGES: "max_tokens"}


def output_cap(surface: str, body: dict[str, Any]) -> tuple[str, int] | None:
    """(field, tokens) of the one cap vLLM checks against the context; None when
    there is none, or it is not a plain integer (vLLM coerces "5" and 5.0, and
    checks them itself)."""
    field = CAP_FIELD.get(surface)
    if surface == CHAT:
        sent = body.get("max_completion_tokens") is not None
        field = "max_completion_tokens" if sent else "max_tokens"
    cap = None if field is None else body.get(field)
    return (field, cap) if field is not None and type(cap) is int else None


class HealthMonitor:
    """Runs the checks of every endpoint of ``groups``; answers model questions."""

    def __init__(self, config: Config, upstream: Upstream, prefill: BackendGroup,
                 decode: BackendGroup, backend_key: BackendKey,
                 prefill_checked: Callable[[Endpoint, bool], None] | None = None) -> None:
        self.config = config
        self.upstream = upstream
        self.groups = (prefill, decode)
        self.prefill = prefill
        self.decode = decode
        # Told of each prefill check that failed (False) and of the first that passed
        # after one failed (True): a restart the checks saw (Mooncake's engine ids).
        self.prefill_checked = prefill_checked
        self.backend_key = backend_key
        self.active = config.health_interval > 0
        self.any_model_name = config.kv_protocol == "sglang"  # no 404 for a model name
        self.checking: dict[Endpoint, asyncio.Task[None]] = {}
        self.key_refused: set[Endpoint] = set()  # answered 401/403: warned about once
        self.keyless: set[Endpoint] = set()  # the same, with the clients' keys forwarded
        # Why a check's GET got no answer (refused, TLS verification, timed out):
        # the line that takes an endpoint out says it.
        self.last_failure: dict[Endpoint, str] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Model refreshes (decode, on demand): numbered as they start.
        self._started = 0
        self._done = 0
        self._refresh: asyncio.Task[None] | None = None
        self._refresh_number = 0
        self._refresh_began = -REFRESH_SPACING_SECONDS  # loop time the last one began
        self._missing: OrderedDict[str, int] = OrderedDict()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.active:
            return
        self._loop = loop
        for group in self.groups:
            group.on_new = self._learn_new(group)
            for endpoint in group.endpoints:
                self._spawn(group, endpoint)  # the first round, which first_checks awaits
        self._loop_task = loop.create_task(self._run())

    async def first_checks(self) -> None:
        """Wait for the first round of checks, at most PD_PROXY_HEALTH_TIMEOUT_SECONDS.

        The daemon reports ready only after this, so /readyz never answers 200
        for a decode that is unreachable from the start; an endpoint whose check
        takes longer is "not checked yet" (proxy.py) until it ends.
        """
        if self.checking:
            await asyncio.wait(list(self.checking.values()), timeout=self.config.health_timeout)

    async def close(self) -> None:
        tasks = [task for task in (self._loop_task, self._refresh) if task is not None]
        tasks += self.checking.values()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for group in self.groups:
            group.on_new = None

    # -- the checks

    async def _run(self) -> None:
        """Every interval, a check for each endpoint not still being checked."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            for group in self.groups:
                for endpoint in group.endpoints:
                    self._spawn(group, endpoint)
            present = {e for group in self.groups for e in group.endpoints}
            self.key_refused &= present
            self.keyless &= present
            for gone in [e for e in self.last_failure if e not in present]:
                del self.last_failure[gone]

    def _learn_new(self, group: BackendGroup) -> Any:
        def learn(endpoint: Endpoint) -> None:
            self._spawn(group, endpoint)  # discovered or registered: learn it at once
        return learn

    def _spawn(self, group: BackendGroup, endpoint: Endpoint) -> None:
        if endpoint in self.checking or self._loop is None:
            return
        task = self._loop.create_task(self._check(group, endpoint))
        self.checking[endpoint] = task
        task.add_done_callback(lambda _: self.checking.pop(endpoint, None))

    async def _check(self, group: BackendGroup, endpoint: Endpoint) -> None:
        status, _ = await self._get(endpoint, HEALTH_TARGET)
        forwarding = self.config.forward_authorization
        if forwarding and status in KEY_REFUSED:
            # With the clients' keys forwarded lowproxy has none of its own: a
            # backend refusing it answered, so it is up (the clients' requests
            # carry the key it wants).
            self._note_keyless(group, endpoint)
            status = 200
        ok = status is not None and 200 <= status < 300
        if ok:
            # vLLM's --api-key guards /v1 only: a wrong key shows on the model list.
            models_status = await self._learn_models(group, endpoint)
            if models_status in KEY_REFUSED:
                if forwarding:
                    self._note_keyless(group, endpoint)  # up; its model list unread
                else:
                    ok, status = False, models_status
        refused = status in KEY_REFUSED
        # A refused key is a misconfiguration, not a flap: out at once.
        failures_allowed = 1 if refused else self.config.health_failures
        failed_before = group.failed_checks.get(endpoint, 0)
        changed = group.record_check(endpoint, ok, failures_allowed)
        if (self.prefill_checked is not None and group is self.prefill
                and (not ok or failed_before) and endpoint in group.endpoints):
            self.prefill_checked(endpoint, ok)
        self._note_key(group, endpoint, refused, status)
        if changed and not refused:
            if ok:
                log.info("%s endpoint %s is healthy again", group.role, endpoint.label)
            else:
                log.warning("%s endpoint %s is out: %d health check(s) failed in a row "
                            "(last: %s)", group.role, endpoint.label,
                            group.failed_checks.get(endpoint, 0),
                            status or self.last_failure.get(endpoint, "no answer"))

    def _note_keyless(self, group: BackendGroup, endpoint: Endpoint) -> None:
        if endpoint not in self.keyless:
            self.keyless.add(endpoint)
            log.info("%s endpoint %s wants a key for lowproxy's health checks, and "
                     "PD_PROXY_FORWARD_AUTHORIZATION leaves lowproxy none of its own: it "
                     "counts as up when it answers, and its model list is not read",
                     group.role, endpoint.label)

    def _note_key(self, group: BackendGroup, endpoint: Endpoint, refused: bool,
                  status: int | None) -> None:
        """One warning when an endpoint starts refusing the backend key, one line when it stops.

        The key itself is never logged: only the settings that hold it.
        """
        if refused and endpoint not in self.key_refused:
            self.key_refused.add(endpoint)
            log.warning("%s endpoint %s is out: it answered %d to lowproxy's health check, so "
                        "the backend key is missing or wrong (set PD_PROXY_BACKEND_API_KEY or "
                        "PD_PROXY_BACKEND_API_KEY_FILE to the key the backend was started "
                        "with, vLLM --api-key)", group.role, endpoint.label, status)
        elif not refused and endpoint in self.key_refused:
            self.key_refused.discard(endpoint)
            log.info("%s endpoint %s no longer refuses the backend key (now: %s)",
                     group.role, endpoint.label, status or "no answer")

    async def _learn_models(self, group: BackendGroup, endpoint: Endpoint) -> int | None:
        """Read and record the endpoint's model list; the status it answered."""
        status, raw = await self._get(endpoint, MODELS_TARGET)
        if status is not None and 200 <= status < 300:
            models = parse_models(raw)
            if models is not None:
                group.record_models(endpoint, models)
        return status

    async def _get(self, endpoint: Endpoint, target: bytes) -> tuple[int | None, bytes]:
        """(status, body) of one GET, or (None, b"") when it failed or timed out."""
        try:
            async with deadline(self.config.health_timeout):
                response = await self.upstream.request(
                    endpoint, b"GET", target, self.backend_key.headers(), None)
                try:
                    raw = await response.read(MAX_ANSWER_BYTES)
                finally:
                    await response.aclose()  # never suspends: safe when cancelled
        except (TimeoutError, UpstreamError) as exc:
            failure = str(exc) if isinstance(exc, UpstreamError) and str(exc) else \
                f"no answer within {self.config.health_timeout:g}s"
            self.last_failure[endpoint] = failure
            log.debug("GET %s on %s failed: %s", target.decode(), endpoint.label, failure)
            return None, b""
        self.last_failure.pop(endpoint, None)
        return response.status, raw

    # -- model refreshes on demand

    async def _refresh_models(self, number: int) -> None:
        try:
            endpoints = list(self.decode.endpoints)
            await asyncio.gather(*(self._learn_models(self.decode, e) for e in endpoints))
        finally:
            # Recorded by the task itself, not by a done callback: a callback runs
            # only on a later loop turn, and a waiter that saw the task done but
            # the count not yet raised would spin without ever yielding to it.
            self._done = max(self._done, number)
            if self._refresh is asyncio.current_task():
                self._refresh = None

    async def refreshed_after(self, number: int) -> None:
        """Return once a decode model refresh that started after refresh ``number`` ended.

        Every pass either awaits a refresh still running (which suspends) or
        starts one, at most one each REFRESH_SPACING_SECONDS; a finished refresh
        has already raised ``_done`` and cleared ``_refresh``, so the loop cannot
        spin on it.
        """
        while self._done <= number:
            task = self._refresh
            if task is not None and not task.done() and self._refresh_number <= number:
                await asyncio.shield(task)  # one in flight began too early: then the next
                continue
            if task is None or task.done():
                loop = asyncio.get_running_loop()
                wait = self._refresh_began + REFRESH_SPACING_SECONDS - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue  # another waiter may have begun one meanwhile
                task = self._begin_refresh(loop)
            await asyncio.shield(task)

    def _begin_refresh(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[None]:
        self._refresh_began = loop.time()
        self._started += 1
        self._refresh_number = self._started
        task = self._refresh = loop.create_task(self._refresh_models(self._refresh_number))
        return task

    def _refresh_if_due(self) -> None:
        """A refresh begun now, not waited for, unless one runs or began within the spacing.

        A model already found missing is answered 404 at once; this lets a LoRA
        adapter loaded since be found within about a second, not at the next
        health round (PD_PROXY_HEALTH_INTERVAL_SECONDS).
        """
        if self._refresh is not None and not self._refresh.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self._refresh_began >= REFRESH_SPACING_SECONDS:
            self._begin_refresh(loop)

    async def refuse(self, model: str | None, body: dict[str, Any], surface: str = CHAT
                     ) -> tuple[int, bytes] | None:
        """(status, body) for a request no decode can serve, before either leg; else None."""
        decode, anthropic = self.decode, surface == MESSAGES
        if not self.active or not decode.lists_known():
            return None
        # SGLang checks no model name (it answers "default", its LoRA "base:adapter"
        # names and any alias): the 404 is vLLM's rule, and only vLLM's.
        if model is not None and not decode.serves(model) and not self.any_model_name:
            first = self._missing.setdefault(model, self._started)
            self._missing.move_to_end(model)
            while len(self._missing) > MISSING_KEPT:
                self._missing.popitem(last=False)
            if self._done <= first:
                await self.refreshed_after(first)
            else:
                self._refresh_if_due()  # it may have been loaded since
            if decode.lists_known() and not decode.serves(model):
                return 404, answers.model_not_found(model, anthropic)
            self._missing.pop(model, None)
        limit = decode.max_model_len(model)
        capped = output_cap(surface, body)
        if limit is None or capped is None or capped[1] <= limit:
            return None
        field, cap = capped
        return 400, answers.invalid_request(field, (
            f"'{field}' is {cap}, more than the model's maximum context length "
            f"of {limit} tokens."), anthropic)

    # -- metrics read at scrape time

    def health_states(self) -> Iterable[tuple[tuple[str, ...], float]]:
        for group in self.groups:
            for endpoint in group.endpoints:
                state = group.health_state(endpoint)
                for shown in ("healthy", "unhealthy", "unknown"):
                    yield (group.role, endpoint.label, shown), float(shown == state)

    def in_flight(self) -> Iterable[tuple[tuple[str, ...], float]]:
        for group in self.groups:
            for endpoint in group.endpoints:
                yield (group.role, endpoint.label), float(endpoint.in_flight)


__all__ = ["HealthMonitor", "parse_models"]
