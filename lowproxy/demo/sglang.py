"""The SGLang side of the demo backend: what an SGLang PD server refuses, and how
it serves a batch. Emulated as SGLang 0.5.23 behaves in PD disaggregation:

* A decode started with ``--disaggregation-mode decode`` refuses every request
  without ``bootstrap_room``: its scheduler aborts it with status 400 and
  "Invalid request: Disaggregated request received without bootstrap room id.
  req.rid='<rid>'". A non-streamed request gets that as a 400 error body; a
  streamed one a 200 whose only event is the error, then ``data: [DONE]``.
* A batch (a list of prompts or token-id lists, or ``n`` > 1) is expanded by
  ``GenerateReqInput.normalize_batch_and_arguments`` into ``prompts x n``
  children: child ``i`` runs as rid ``<rid>_<i>``, in room ``room + i`` when
  one room was given, or ``rooms[i]`` of the list repeated ``n`` times.
* ``POST /abort_request {"rid"}`` aborts the exact rid (one tokenizer worker);
  a batch ends once each of its children is aborted.
* ``--api-key`` guards every path but ``/health*`` and ``/metrics``.
* The native ``POST /generate`` (``text`` or ``input_ids``, ``sampling_params``
  with ``max_new_tokens`` and ``n``) answers ``{"text", "output_ids",
  "meta_info"}`` per child (a list for a batch).

Nothing here is shared with the proxy's legs code: an emulator that shares it
would agree with its bugs.
"""

from __future__ import annotations

from typing import Any

from ..answers import json_body
from ..downstream.messages import ResponseWriter as Responder
from .engine import (
    COMPLETIONS,
    MAX_SEQUENCES,
    MESSAGES,
    RESPONSES,
    Parsed,
    Problem,
    bounded,
    sampling_of,
)
from .kv import prompt_ids

SGLANG_GENERATE = "sglang-generate"  # SGLang's native POST /generate


def is_native_generate(path: str) -> bool:
    return path.endswith("/generate") and not path.endswith("/inference/v1/generate")


def open_path(path: str) -> bool:
    """The paths SGLang's --api-key leaves open (its auth middleware)."""
    return path.startswith("/health") or path.startswith("/metrics")


def _samples(route: str, body: dict[str, Any]) -> int:
    params = body.get("sampling_params") if route == SGLANG_GENERATE else body
    if isinstance(params, list):
        params = params[0] if params and isinstance(params[0], dict) else None
    n = params.get("n") if isinstance(params, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def batch_size(route: str, body: dict[str, Any]) -> int | None:
    """How many children SGLang makes of a batch request; None for a single one."""
    if route == COMPLETIONS:
        prompt = body.get("prompt")
    elif route == SGLANG_GENERATE:
        prompt = body.get("text") if body.get("text") is not None else body.get("input_ids")
    else:
        prompt = None  # chat, Responses and Messages carry one conversation
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    n = _samples(route, body)
    if not several and n == 1:
        return None
    return (len(prompt) if several and isinstance(prompt, list) else 1) * n


def child_rids(rid: str, size: int | None) -> list[str]:
    return [rid] if size is None else [f"{rid}_{i}" for i in range(size)]


def rooms_of(route: str, body: dict[str, Any], size: int | None) -> list[Any]:
    """Each child's room, as SGLang expands the one or the list it was given."""
    room = body.get("bootstrap_room")
    if size is None:
        if isinstance(room, list):  # inferred: a single request's room is one int
            raise Problem(400, "bootstrap_room must be an integer for a single request",
                          "bootstrap_room")
        return [room]
    if isinstance(room, list):
        if size > MAX_SEQUENCES:  # bounded() refuses it; never expand it first
            raise Problem(400, "too many sequences", "n")
        expanded = room * _samples(route, body)
        if len(expanded) < size:  # SGLang indexes past the end: an internal error
            raise Problem(500, "list index out of range", None, "InternalServerError")
        return expanded[:size]
    if room is None:
        return [None] * size
    if not isinstance(room, int) or isinstance(room, bool):
        raise Problem(400, "bootstrap_room must be an integer", "bootstrap_room")
    return [room + i for i in range(size)]


def refusal_message(rid: str) -> str:
    return ("Invalid request: Disaggregated request received without bootstrap room id. "
            f"req.rid={rid!r}")


async def refuse_without_room(responder: Responder, route: str, rid: str,
                              stream: bool) -> None:
    """SGLang's answer when its decode scheduler aborts a request with no room."""
    message = refusal_message(rid)
    if route == MESSAGES:
        error: dict[str, Any] = {"type": "error", "error": {
            "type": "invalid_request_error", "message": message}}
    elif route == SGLANG_GENERATE:
        error = {"error": {"message": message}}
    elif route == RESPONSES:
        error = {"error": {"message": message, "type": "BadRequestError", "param": None,
                           "code": 400}}
    else:
        error = {"object": "error", "message": message, "type": "BadRequestError",
                 "param": None, "code": 400}
    if not stream:
        await responder.send_json(400, error)
        return
    await responder.start(200, [(b"content-type", b"text/event-stream; charset=utf-8")])
    await responder.write(b"data: " + json_body(error) + b"\n\ndata: [DONE]\n\n")
    await responder.end()


# -- the native POST /generate


def parse_generate(body: dict[str, Any]) -> Parsed:
    """``text`` or ``input_ids`` (one or a batch) and ``sampling_params``."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise Problem(400, "Either text, input_ids or input_embeds should be provided.")
    given = text if text is not None else ids
    batch = isinstance(given, list) and bool(given) and not isinstance(given[0], int)
    prompts = [prompt_ids(p) for p in given] if batch and isinstance(given, list) \
        else [prompt_ids(given)]
    params = body.get("sampling_params") or {}
    if isinstance(params, list):
        params = params[0] if params else {}
    if not isinstance(params, dict):
        raise Problem(400, "sampling_params must be an object", "sampling_params")
    return bounded(Parsed(SGLANG_GENERATE, sampling_of(params, ("max_new_tokens",)), prompts,
                          bool(body.get("stream"))))


def generate_answers(result: Any) -> tuple[list[dict[str, Any]], bool]:
    """One ``{"text", "output_ids", "meta_info"}`` per child, in SGLang's order
    (child ``i`` is prompt ``i % prompts``, sample ``i // prompts``); and
    whether the request was a batch (answered with a list)."""
    parsed: Parsed = result.parsed
    batch = batch_size(SGLANG_GENERATE, result.body)
    rids = child_rids(str(result.body.get("rid") or result.request_id), batch)
    answers = []
    count = len(parsed.prompts)
    for index, rid in enumerate(rids):
        prompt, sample = index % count, index // count
        out = result.outputs[prompt][sample % len(result.outputs[prompt])]
        reason: dict[str, Any] = ({"type": "length", "length": len(out.token_ids)}
                                  if out.finish_reason == "length" else
                                  {"type": "stop", "matched": out.stop_reason})
        answers.append({"text": out.text, "output_ids": out.token_ids, "meta_info": {
            "id": rid, "finish_reason": reason,
            "prompt_tokens": len(parsed.prompts[prompt]),
            "completion_tokens": len(out.token_ids), "cached_tokens": result.cached_tokens}})
    return answers, batch is not None


async def send_generate(responder: Responder, result: Any) -> None:
    """Non-streamed: the answer (a list for a batch). Streamed: each child's final
    state as one event (with its ``index``), then ``data: [DONE]``."""
    answers, batch = generate_answers(result)
    if not result.parsed.stream:
        await responder.send_json(200, answers if batch else answers[0])
        return
    await responder.start(200, [(b"content-type", b"text/event-stream; charset=utf-8")])
    for index, answer in enumerate(answers):
        await responder.write(b"data: " + json_body({**answer, "index": index}) + b"\n\n")
    await responder.write(b"data: [DONE]\n\n")
    await responder.end()


def abort(backend: Any, body: dict[str, Any]) -> None:
    """``POST /abort_request {"rid"}`` on a backend.DemoBackend: the request served
    under exactly that rid (one tokenizer worker) ends at once, a batch once each
    of its children (``<rid>_<i>``) is; ``abort_all`` ends every request."""
    rid = str(body.get("rid") or "")
    backend.abort_requests.append(rid)
    for entry in list(backend._inflight):
        if entry.task.done():
            continue
        if body.get("abort_all"):
            entry.pending.clear()
        entry.pending.discard(rid)
        if not entry.pending:
            entry.aborted = True
            backend.aborted.append(entry.rid)
            entry.task.cancel()

def lacks_room(body: dict[str, Any]) -> bool:
    """No ``bootstrap_room``, or a list of them with a gap: SGLang's decode refuses."""
    room = body.get("bootstrap_room")
    return room is None or (isinstance(room, list) and any(r is None for r in room))
