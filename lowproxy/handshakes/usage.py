"""Usage that bills right: the prefill's cached prompt-token count in decode's answer.

The prefill's own count of cached prompt tokens is the truth: a Mooncake
decode reports the pulled prompt as cached, and NIXL decodes before vLLM 0.33
report none. Pure functions on bytes and dicts; dispatch.py applies them only
when the prefill reported a figure (PD_PROXY_REWRITE_CACHED_TOKENS).

Streamed answers are rewritten only in the events that carry usage, found by
a byte search before anything is parsed, so events without usage cost one
``in`` test per read. Each event is expected whole within one read (vLLM
writes one event per chunk); an event split across reads is passed on as is.
"""

from __future__ import annotations

import json
from typing import Any

from .._types import Body
from ..routes import CHAT, COMPLETIONS, MESSAGES, RESPONSES

# What only an event carrying usage contains, per surface.
STREAM_MARKERS: dict[str, tuple[bytes, ...]] = {
    CHAT: (b'"prompt_tokens"',),
    COMPLETIONS: (b'"prompt_tokens"',),
    RESPONSES: (b'"response.completed"', b'"response.incomplete"'),
    MESSAGES: (b'"message_start"', b'"message_delta"'),
}


def cached_tokens_of(surface: str, answer: Any) -> int | None:
    """The cached prompt-token count a (prefill) answer reports, or None."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return None
    if surface in (CHAT, COMPLETIONS):
        details = usage.get("prompt_tokens_details")
        value = details.get("cached_tokens") if isinstance(details, dict) else None
    elif surface == RESPONSES:
        details = usage.get("input_tokens_details")
        value = details.get("cached_tokens") if isinstance(details, dict) else None
    elif surface == MESSAGES:
        value = usage.get("cache_read_input_tokens")
    else:
        return None
    return value if _count(value) else None


def rewrite_usage(surface: str, usage: Any, cached: int) -> bool:
    """Put ``cached`` in one usage object, in the surface's shape; False if not one."""
    if not isinstance(usage, dict):
        return False
    if surface in (CHAT, COMPLETIONS):
        if "prompt_tokens" not in usage:
            return False
        details = usage.get("prompt_tokens_details")
        usage["prompt_tokens_details"] = dict(details or {}, cached_tokens=cached)
    elif surface == RESPONSES:
        details = usage.get("input_tokens_details")
        usage["input_tokens_details"] = dict(details or {}, cached_tokens=cached)
    elif surface == MESSAGES:
        if not _count(usage.get("input_tokens")):
            return False  # message_delta without input figures: nothing to adjust
        created = usage.get("cache_creation_input_tokens") or 0
        prompt = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + created
        # input + cache read + cache creation still add up to the prompt.
        usage["cache_read_input_tokens"] = min(cached, prompt - created)
        usage["input_tokens"] = prompt - created - usage["cache_read_input_tokens"]
    else:
        return False
    return True


def rewrite_body(surface: str, raw: bytes, cached: int) -> bytes | None:
    """A non-streamed answer with the prefill's figure, or None to relay it as it is."""
    answer = _object(raw)
    if answer is None or not rewrite_usage(surface, answer.get("usage"), cached):
        return None
    return json.dumps(answer, separators=(",", ":")).encode()


def rewrite_events(surface: str, piece: bytes, cached: int) -> bytes:
    """One read of a streamed answer with the figure put in its usage events."""
    markers = STREAM_MARKERS.get(surface, ())
    if not any(marker in piece for marker in markers):
        return piece
    lines = piece.split(b"\n")
    for index, line in enumerate(lines):
        if line.startswith(b"data: ") and any(marker in line for marker in markers):
            event = _object(line[6:])
            if event is not None and rewrite_usage(surface, _usage_in(surface, event), cached):
                lines[index] = b"data: " + json.dumps(event, separators=(",", ":")).encode()
    return b"\n".join(lines)


def _usage_in(surface: str, event: Body) -> Any:
    if surface == RESPONSES:
        response = event.get("response")
        return response.get("usage") if isinstance(response, dict) else None
    if surface == MESSAGES and event.get("type") == "message_start":
        message = event.get("message")
        return message.get("usage") if isinstance(message, dict) else None
    return event.get("usage")


def _object(raw: bytes) -> Body | None:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
