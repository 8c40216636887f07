"""Usage that bills right: the prefill's cached prompt-token count in decode's answer.

The prefill's own count of cached prompt tokens is the truth: a Mooncake
decode reports the pulled prompt as cached, and NIXL decodes before vLLM 0.33
report none. Pure functions on bytes and dicts; dispatch.py applies them only
when the prefill reported a figure (PD_PROXY_REWRITE_CACHED_TOKENS).

Streamed answers are rewritten only in the events that carry usage, found by
a byte search before anything is parsed, so events without usage cost one
``find`` per read. The relay (proxy/answer_copy.py) hands these functions whole
lines: a data line cut across reads is held until its newline arrives.

A usage object of any other shape (a field of the wrong type, a figure that is
not a non-negative integer) is one the proxy does not understand: its answer
or event is relayed exactly as decode sent it, never "fixed". So is one that
cannot be written back as the JSON it came as: Python's parser reads 1e400 as
infinity (and takes NaN and Infinity literals), which json.dumps would write as
the bare word Infinity, invalid JSON that strict parsers (serde_json, JSON.parse
of other runtimes' SDKs) refuse.
"""

from __future__ import annotations

from typing import Any

from .._types import Body
from ..routes import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from .json_bytes import DECODER, data_line, finite_json, object_of, skip_space

# What only an event carrying usage contains, per surface.
STREAM_MARKERS: dict[str, tuple[bytes, ...]] = {
    CHAT: (b'"prompt_tokens"',),
    COMPLETIONS: (b'"prompt_tokens"',),
    RESPONSES: (b'"response.completed"', b'"response.incomplete"'),
    MESSAGES: (b'"message_start"', b'"message_delta"'),
}




def carries_usage(surface: str, pieces: list[bytes]) -> bool:
    """Whether any piece of one read of a streamed answer may hold a usage event.

    The test every streamed event pays, so one call: those without usage
    (all but one or two of an answer's) go on untouched."""
    markers = STREAM_MARKERS.get(surface, ())
    for piece in pieces:
        for marker in markers:
            if piece.find(marker) >= 0:
                return True
    return False


def _has_marker(markers: tuple[bytes, ...], data: bytes) -> bool:
    # find, not ``marker in data``: for bytes, ``in`` first tries the marker as an
    # integer and formats the TypeError that raises (CPython 3.11), a few
    # thousand instructions per streamed event; a regex search costs more still.
    for marker in markers:
        if data.find(marker) >= 0:
            return True
    return False


def _usage_of(answer: Any) -> Body | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else None


def cached_tokens_of(surface: str, answer: Any) -> int | None:
    """The cached prompt-token count a (prefill) answer reports, or None."""
    usage = _usage_of(answer)
    if usage is None:
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


def prompt_tokens_of(surface: str, answer: Any) -> int | None:
    """The prompt's whole token count a (prefill) answer reports, or None."""
    usage = _usage_of(answer)
    if usage is None:
        return None
    if surface in (CHAT, COMPLETIONS):
        value = usage.get("prompt_tokens")
    elif surface == RESPONSES:
        value = usage.get("input_tokens")
    elif surface == MESSAGES:  # input_tokens there excludes the cached part
        parts = [usage.get(name) or 0 for name in
                 ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
        value = sum(parts) if all(_count(part) for part in parts) else None
    else:
        return None
    return value if _count(value) else None


def rewrite_usage(surface: str, usage: Any, cached: int) -> bool:
    """Put ``cached`` in one usage object, in the surface's shape; False if not one.

    Nothing is changed unless every figure used has the type vLLM gives it, so
    a False answer leaves ``usage`` as it was.
    """
    if not isinstance(usage, dict):
        return False
    if surface in (CHAT, COMPLETIONS):
        return _put_details(usage, "prompt_tokens", "prompt_tokens_details", cached)
    if surface == RESPONSES:
        return _put_details(usage, "input_tokens", "input_tokens_details", cached)
    if surface != MESSAGES:
        return False
    if not _count(usage.get("input_tokens")):
        return False  # message_delta without input figures: nothing to adjust
    read, created = usage.get("cache_read_input_tokens"), usage.get("cache_creation_input_tokens")
    if not all(value is None or _count(value) for value in (read, created)):
        return False
    created = created or 0
    prompt = usage["input_tokens"] + (read or 0) + created
    # input + cache read + cache creation still add up to the prompt.
    usage["cache_read_input_tokens"] = min(cached, prompt - created)
    usage["input_tokens"] = prompt - created - usage["cache_read_input_tokens"]
    return True


def _put_details(usage: Body, total: str, field: str, cached: int) -> bool:
    """cached_tokens into usage[field] (an object, or absent), beside a count in usage[total]."""
    details = usage.get(field)
    if not _count(usage.get(total)) or not (details is None or isinstance(details, dict)):
        return False
    usage[field] = dict(details or {}, cached_tokens=cached)
    return True


def rewrite_body(surface: str, raw: bytes, cached: int) -> bytes | None:
    """A non-streamed answer with the prefill's figure, or None to relay it as it is.

    Only the usage object's bytes change when they can be found for certain
    (splice_usage): the rest of decode's answer goes on byte for byte, and
    is not serialised again.
    """
    answer = object_of(raw)
    if answer is None:
        return None
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    before = dict(usage)
    if not rewrite_usage(surface, usage, cached):
        return None
    spliced = splice_usage(raw, before, usage)  # rewrite_usage took it: a dict
    return spliced if spliced is not None else finite_json(answer)


def splice_usage(raw: bytes, before: Body, after: Body) -> bytes | None:
    """``raw`` with its top-level usage object (``before``) written as ``after``; None
    unless that object's bytes are found for certain.

    Certain: ``"usage"`` occurs once in the bytes (a string can hold it only
    escaped), a colon and an object follow it, and that object reads back as
    ``before``. Anything else (the key spelled with escapes, a second
    occurrence) leaves the whole answer to be written again.
    """
    if raw.count(b'"usage"') != 1:
        return None
    key = raw.find(b'"usage"') + len(b'"usage"')
    colon = skip_space(raw, key)
    if raw[colon:colon + 1] != b":":
        return None
    start = skip_space(raw, colon + 1)
    if raw[start:start + 1] != b"{":
        return None
    try:
        text = raw[start:].decode("utf-8")
        found, end = DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return None
    written = finite_json(after)
    if found != before or written is None:
        return None
    return raw[:start] + written + text[end:].encode("utf-8")


def rewrite_events(surface: str, piece: bytes, cached: int) -> bytes:
    """One read of a streamed answer with the figure put in its usage events."""
    markers = STREAM_MARKERS.get(surface, ())
    if not _has_marker(markers, piece):
        return piece
    lines = piece.split(b"\n")
    for index, line in enumerate(lines):
        if line.startswith(b"data: ") and _has_marker(markers, line):
            event = object_of(line[6:])
            if event is not None and rewrite_usage(surface, _usage_in(surface, event), cached):
                written = finite_json(event)
                if written is not None:
                    lines[index] = data_line(written, line)
    return b"\n".join(lines)


def _usage_in(surface: str, event: Body) -> Any:
    if surface == RESPONSES:
        response = event.get("response")
        return response.get("usage") if isinstance(response, dict) else None
    if surface == MESSAGES and event.get("type") == "message_start":
        message = event.get("message")
        return message.get("usage") if isinstance(message, dict) else None
    return event.get("usage")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
