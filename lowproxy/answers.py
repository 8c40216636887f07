"""Every JSON answer lowproxy writes itself, in one place.

Bodies marked GCO are the GCO Mooncake PD proxy's answers, byte for byte, on
every route it gave them: an operator swapping that proxy for this one sees
the same bodies (README, "Answers lowproxy writes itself"). Every other error
is in the shape of the surface the client called: Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on the Messages surface
(``anthropic=True``, routes.speaks_anthropic), OpenAI's
``{"error": {"message", "type", "param", "code"}}`` everywhere else (``code``
is the status, as vLLM's own errors carry it). Nothing here runs for a request
that succeeds.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}

# GCO: the liveness probe, and the admin path.
HEALTH_OK = b'{"status":"ok"}'
ADMIN_OK = b'{"status":"ok"}'
ADMIN_FORBIDDEN = b'{"error":"forbidden"}'
READY_OK = b'{"status":"ready"}'

# Anthropic's error type for each status (its API's "HTTP errors" list; other
# 4xx are invalid_request_error there too).
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 502: "api_error", 503: "overloaded_error",
                    504: "timeout_error"}


# Built once: json.dumps with separators builds an encoder on every call.
# check_circular off: every value encoded here comes from a JSON parse or the
# proxy's own literals, so none contains itself, and strict_json bounds the depth
# (the check costs a dict insert and delete per container). UTF-8 as the client
# sent it costs half of writing every non-ASCII character as an escape, and it is
# the same JSON to any parser; a lone surrogate (a client's "\ud800" escape)
# cannot be UTF-8, so a value holding one is written by the escaping encoder.
COMPACT_UTF8_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False,
                                     check_circular=False)
COMPACT_JSON = json.JSONEncoder(separators=(",", ":"), check_circular=False)


def json_body(obj: Any) -> bytes:
    """Compact JSON in UTF-8; escaped ASCII only when a lone surrogate needs it."""
    try:
        return COMPACT_UTF8_JSON.encode(obj).encode()
    except UnicodeEncodeError:
        return COMPACT_JSON.encode(obj).encode()


def error_body(status: int, message: str, kind: str, param: str | None = None,
               code: int | str | None = None, anthropic: bool = False) -> bytes:
    """One error in the surface's shape; ``kind`` is the OpenAI-shape type."""
    if anthropic:
        shown = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500
                                     else "api_error")
        return json_body({"type": "error", "error": {"type": shown, "message": message}})
    return json_body({"error": {"message": message, "type": kind, "param": param,
                                "code": status if code is None else code}})


# The metrics listener serves probes and /metrics only.
NOT_FOUND = error_body(404, "not found", "not_found_error")


def not_ready(reason: str) -> bytes:
    return json_body({"status": "unavailable", "reason": reason})


def invalid_body(message: str) -> bytes:
    """GCO: a body that is not a JSON object is ``400 {"error": "<why>"}``, on every route."""
    return json_body({"error": message})


def no_decode_backend(message: str) -> bytes:
    """GCO: PD_PROXY_NO_DECODE_BACKEND_STATUS with PD_PROXY_NO_DECODE_BACKEND_MESSAGE."""
    return json_body({"error": {"message": message, "type": "no_decode_backend"}})


def unauthorized(anthropic: bool = False) -> bytes:
    how = "x-api-key: <key> or authorization: Bearer <key>" if anthropic \
        else "authorization: Bearer <key>"
    return error_body(401, f"a valid API key is required: {how}", "invalid_api_key",
                      anthropic=anthropic)


def invalid_request(param: str, message: str, anthropic: bool = False) -> bytes:
    """A request the model server would refuse, naming the field."""
    return error_body(400, message, "invalid_request_error", param, anthropic=anthropic)


def model_not_found(model: str, anthropic: bool = False) -> bytes:
    """OpenAI's answer for a model no backend serves (its code, param named)."""
    return error_body(404, f"The model `{model}` does not exist.", "invalid_request_error",
                      "model", "model_not_found", anthropic)


def shutting_down(anthropic: bool = False) -> bytes:
    return error_body(503, "shutting down", "unavailable", anthropic=anthropic)


def prefill_failed(detail: str, anthropic: bool = False) -> bytes:
    return error_body(502, f"prefill failed: {detail}", "prefill_failed", anthropic=anthropic)


def prefill_refused(status: int, anthropic: bool = False) -> bytes:
    """Prefill refused the request without a body of its own to relay."""
    return error_body(status, "prefill refused the request", "invalid_request_error",
                      anthropic=anthropic)


def prefill_target_refused(status: int, message: str, anthropic: bool = False) -> bytes:
    return error_body(status, message, "prefill_target_refused", "x-prefiller-host-port",
                      anthropic=anthropic)


def decode_failed(status: int, anthropic: bool = False) -> bytes:
    return error_body(status, "decode backend failed before answering", "upstream_error",
                      anthropic=anthropic)


def decode_timed_out(anthropic: bool = False) -> bytes:
    return error_body(504, "decode backend timed out", "upstream_timeout", anthropic=anthropic)


def bad_gateway(anthropic: bool = False) -> bytes:
    return error_body(502, "bad gateway", "upstream_error", anthropic=anthropic)


def internal_error(anthropic: bool = False) -> bytes:
    return error_body(500, "internal proxy error", "internal_error", anthropic=anthropic)


def canned_response(status: int, body: bytes, extra: bytes = b"") -> bytes:
    """A whole response written without h11, for sockets h11 can no longer serve."""
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n%s\r\n" % (status, REASONS.get(status, b""), len(body), extra)
            ) + body
