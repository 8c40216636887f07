"""The demo backend's records, fault knobs and error answers (see backend.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from ..answers import json_body
from ..downstream.messages import ClientRequest
from ..downstream.messages import ResponseWriter as Responder
from .engine import MESSAGES
from .kv import KvRegistry

DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


@dataclass
class Received:
    method: str
    path: str
    target: str
    headers: list[tuple[bytes, bytes]]
    body: Any
    raw_body: bytes

    def header(self, name: str) -> bytes | None:
        key = name.lower().encode()
        for header, value in self.headers:
            if header == key:
                return value
        return None


@dataclass
class Faults:
    """Knobs a test turns to make this backend misbehave."""

    status: int | None = None          # answer generation requests with this status
    delay: float = 0.0                 # wait this long before answering
    hang: bool = False                 # accept, read, never answer
    die_after_chunks: int | None = None  # stream this many chunks, then drop the connection
    close_without_response: bool = False
    kv_params: Any = "default"         # prefill's kv_transfer_params answer ("default": NIXL-like)
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)


@dataclass(eq=False)
class Inflight:
    """A generation request being served, so an abort or the engine's death can end it."""

    rid: str
    task: asyncio.Future[None]
    pending: set[str] = field(default_factory=set)  # the rids SGLang serves it as, not aborted
    aborted: bool = False
    dead: bool = False


async def send_error(responder: Responder, status: int, message: str, kind: str,
                     param: str | None = None, route: str = "", streamed: bool = False) -> None:
    """vLLM's error shape (``{"error": {message, type, param, code}}``); the
    Anthropic endpoint answers in Anthropic's (``{"type": "error", "error": ...}``).
    ``streamed``: failing a stream vLLM 0.30+ has begun: 200, the error as an
    event, then [DONE]."""
    if streamed:
        await responder.start(200, [(b"content-type", b"text/event-stream; charset=utf-8")])
        await responder.write(b"data: " + json_body({"error": {
            "message": message, "type": kind, "param": param, "code": status}}) + b"\n\n"
            b"data: [DONE]\n\n")
        await responder.end()
        return
    if route == MESSAGES:
        kind = {404: "not_found_error", 400: "invalid_request_error"}.get(status, "api_error")
        await responder.send_json(status, {"type": "error", "error": {
            "type": kind, "message": message}})
        return
    await responder.send_json(status, {"error": {"message": message, "type": kind,
                                                 "param": param, "code": status}})


async def answer_aborted(responder: Responder, rid: str) -> None:
    """SGLang ends an aborted request at once with finish_reason type "abort"."""
    choice = {"index": 0, "text": "", "logprobs": None,
              "finish_reason": {"type": "abort", "message": f"Abort request {rid}"}}
    if responder.started:
        if not responder.ended:
            await responder.write(b"data: " + json_body({"choices": [choice]}) + b"\n\n"
                                  b"data: [DONE]\n\n")
            await responder.end()
        return
    await responder.send_json(200, {"id": rid, "object": "abort", "choices": [choice]})


async def serve_kv(registry: KvRegistry, request: ClientRequest, responder: Responder) -> None:
    """``GET /kv?key=K&take=0|1`` on the bootstrap server: the emulated transfer
    for backends in separate processes (200 with the engine id, or 404)."""
    query = parse_qs(request.target.decode("latin-1").partition("?")[2])
    key = (query.get("key") or [""])[0]
    engine = registry.engine_of(key)
    if engine is None:
        await responder.send_json(404, {"detail": "no such KV"})
        return
    if (query.get("take") or ["0"])[0] == "1":
        registry.take(key)
    await responder.send_json(200, {"engine_id": engine})
