"""The admin paths: register, remove and list backends at run time.

``POST .../instances/add`` is the GCO proxy's admin path: an authorised call
with an empty body (or ``{}``, or any body without ``type``, as the GCO
proxy accepted) still answers ``{"status":"ok"}`` and does nothing. With
``{"type": "prefill"|"decode", "instance": "http://host:port"}`` it checks that
the instance answers ``GET /v1/models`` (with the backend key, since vLLM's
--api-key guards /v1) and adds it to that group. ``POST .../instances/remove``
takes the same body; ``GET .../instances`` lists every endpoint.

Every admin path needs ADMIN_API_KEY (``x-admin-api-key`` or ``Authorization:
Bearer``) and is answered here, never forwarded. Registrations live in memory:
a restart forgets them (DNS discovery is the durable way). The model list the
check read routes at once (backends.py), before the first health check.

With --workers N (N > 1) add and remove are refused (409): each worker holds
its own groups and a registration would reach only the worker that took the
connection, so GET /instances would differ from call to call and most traffic
would ignore it. Workers share no state but the listening socket and their
metrics files; broadcasting through files would leave every registration
half-applied for a while and lost in a race of two. The refusal says how to
get the same result: the URL settings or a dns+ name, which every worker reads.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from .. import answers
from ..config.settings import EndpointSpec, parse_endpoint
from ..downstream.messages import ClientRequest, ResponseWriter
from ..handshakes.client_body import BodyError, parse_client_body
from ..keys import BackendKey, bearer_token
from ..routes import admin_action
from ..routing.groups import BackendGroup, ModelList, parse_models
from ..timeouts import deadline
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Upstream, UpstreamError

log = logging.getLogger("lowproxy.admin")

CHECK_SECONDS = 5.0  # an instance must answer GET /v1/models within this
CHECK_TARGET = b"/v1/models"
MAX_CHECK_ANSWER_BYTES = 1024 * 1024


class BadBody(ValueError):
    """An admin body that cannot be used; the message is the client's answer."""


class Instances:
    """Answers the admin paths over the prefill and decode groups."""

    def __init__(self, admin_key: str, prefill: BackendGroup, decode: BackendGroup,
                 upstream: Upstream, backend_key: BackendKey, workers: int = 1) -> None:
        self._admin_key = admin_key.encode()
        self.workers = workers
        self.groups = {"prefill": prefill, "decode": decode}
        self.upstream = upstream
        self.backend_key = backend_key

    def authorised(self, request: ClientRequest) -> bool:
        provided = request.header(b"x-admin-api-key")
        if not provided:
            authorization = request.header(b"authorization")
            # The GCO proxy took the header with any "Bearer " removed, so a bare
            # key there is the key too (automation written for it sends that).
            provided = bearer_token(authorization) or \
                (authorization.strip() if authorization else None)
        return bool(self._admin_key and provided
                    and hmac.compare_digest(provided, self._admin_key))

    async def handle(self, request: ClientRequest, responder: ResponseWriter) -> None:
        if not self.authorised(request):
            await responder.send_bytes(403, answers.ADMIN_FORBIDDEN)
            return
        action = admin_action(request.path)
        wanted = b"GET" if action == "list" else b"POST"
        if request.method != wanted:
            await responder.send_bytes(405, answers.error_body(
                405, f"use {wanted.decode()} on this path", "method_not_allowed"),
                [(b"allow", wanted)])
            return
        if action == "list":
            await responder.send_bytes(200, answers.json_body(self.listing()))
            return
        try:
            target = _parse_body(request.body)
        except BadBody as exc:
            await responder.send_bytes(400, answers.error_body(400, str(exc),
                                                               "invalid_request"))
            return
        if target is None:  # the GCO call: nothing to do
            await responder.send_bytes(200, answers.ADMIN_OK)
            return
        role, spec = target
        if self.workers > 1:
            await responder.send_bytes(409, _refused_under_workers(action, self.workers))
            return
        if action == "add":
            status, body = await self.add(role, spec)
        else:
            status, body = self.remove(role, spec)
        await responder.send_bytes(status, body)

    async def add(self, role: str, spec: EndpointSpec) -> tuple[int, bytes]:
        group = self.groups[role]
        present = group.find(spec)
        if present is not None:
            return 200, _ok(role, present)
        endpoint = Endpoint(spec)
        why, models = await self._check(endpoint)
        if why is not None:
            self.upstream.close_idle(endpoint)
            log.warning("admin: %s instance %s not added: %s", role, _shown(endpoint), why)
            return 502, answers.error_body(502, f"{_shown(endpoint)}: {why}",
                                           "instance_unreachable")
        present = group.find(spec)  # added meanwhile by a concurrent call
        if present is not None:
            self.upstream.close_idle(endpoint)
            return 200, _ok(role, present)
        # The list just read routes at once: a decode for another model must get
        # none of this model's requests while its first health check is pending.
        group.add(endpoint, models)
        log.info("admin: %s instance %s added (in memory: a restart forgets it)",
                 role, _shown(endpoint))
        return 200, _ok(role, endpoint)

    def remove(self, role: str, spec: EndpointSpec) -> tuple[int, bytes]:
        group = self.groups[role]
        endpoint = group.find(spec)
        if endpoint is None:
            return 404, answers.error_body(404, f"no {role} instance {spec.label}",
                                           "not_found")
        if group.source(endpoint) == "dns":
            # The next DNS refresh would bring it back: the Service decides.
            return 409, answers.error_body(
                409, f"{endpoint.label} was discovered by DNS; remove it from the Service",
                "discovered_instance")
        group.remove(endpoint, self.upstream)
        log.info("admin: %s instance %s removed (%d request(s) in flight finish)",
                 role, _shown(endpoint), endpoint.in_flight)
        return 200, _ok(role, endpoint)

    async def _check(self, endpoint: Endpoint) -> tuple[str | None, ModelList | None]:
        """(why the instance cannot be used, or None; the models it listed, if in vLLM's shape)."""
        try:
            async with deadline(CHECK_SECONDS):
                response = await self.upstream.request(
                    endpoint, b"GET", CHECK_TARGET, self.backend_key.headers(), None)
                try:
                    raw = await response.read(MAX_CHECK_ANSWER_BYTES)
                finally:
                    await response.aclose()
        except TimeoutError:
            return f"did not answer GET /v1/models within {CHECK_SECONDS:g}s", None
        except UpstreamError as exc:
            return exc.detail, None
        if not 200 <= response.status < 300:
            return f"answered {response.status} to GET /v1/models", None
        return None, parse_models(raw)

    def listing(self) -> dict[str, Any]:
        now = time.monotonic()
        listed: dict[str, Any] = {}
        removed = []
        for role, group in self.groups.items():
            listed[role] = [{
                "instance": _shown(endpoint),
                "source": group.source(endpoint),
                "state": "usable" if endpoint.usable(now) else "cooling down",
                "in_flight": endpoint.in_flight,
            } for endpoint in group.endpoints]
            removed += [{"type": role, "instance": _shown(endpoint),
                         "in_flight": endpoint.in_flight} for endpoint in group.retired]
        listed["removed"] = removed  # finishing their requests in flight
        return listed


def _parse_body(raw: bytes) -> tuple[str, EndpointSpec] | None:
    """(role, spec) from an admin body; None for a body without ``type``."""
    try:
        body = parse_client_body(raw)
    except BodyError as exc:
        raise BadBody(str(exc)) from None
    if "type" not in body:
        return None
    role, instance = body.get("type"), body.get("instance")
    if role not in ("prefill", "decode"):
        raise BadBody('"type" must be "prefill" or "decode"')
    if not isinstance(instance, str) or not instance.strip():
        raise BadBody('"instance" must be a URL such as "http://host:8000" or "host:8000"')
    text = instance.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        spec = parse_endpoint(text)
    except ValueError as exc:
        raise BadBody(f'"instance": {exc}') from None
    if spec.discover:
        raise BadBody('"instance": dns+ names are discovered from PD_PROXY_*_URL, not added')
    if spec.base_path:
        raise BadBody('"instance": a backend URL takes no path')
    return role, spec


def _refused_under_workers(action: str | None, workers: int) -> bytes:
    return answers.error_body(
        409, f"instances/{action} is refused with {workers} workers (PD_PROXY_WORKERS): "
        "a registration would reach only the worker that took this connection; list the "
        "instance in PD_PROXY_PREFILL_URL or PD_PROXY_DECODE_URL (or behind a dns+ name), "
        "or run one worker", "registration_needs_one_worker")


def _shown(endpoint: Endpoint) -> str:
    port = endpoint.spec.bootstrap_port
    return endpoint.label + (f"#bootstrap_port={port}" if port else "")


def _ok(role: str, endpoint: Endpoint) -> bytes:
    return answers.json_body({"status": "ok", "type": role, "instance": _shown(endpoint)})


__all__ = ["Instances"]
