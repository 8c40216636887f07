"""Every JSON answer lowproxy writes itself, in one place.

Bodies marked GCO are the GCO Mooncake PD proxy's answers, byte for byte: an
operator swapping that proxy for this one sees the same bodies. The rest use
the OpenAI error shape ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}

# GCO: the liveness and readiness probes, and the admin path.
HEALTH_OK = b'{"status":"ok"}'
READY_OK = b'{"status":"ready"}'
ADMIN_OK = b'{"status":"ok"}'
ADMIN_FORBIDDEN = b'{"error":"forbidden"}'
# The metrics listener serves probes and /metrics only.
NOT_FOUND = b'{"error":"not found"}'


def json_body(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def error_body(status: int, message: str, kind: str) -> bytes:
    return json_body({"error": {"message": message, "type": kind, "code": status}})


def not_ready(reason: str) -> bytes:
    return json_body({"status": "unavailable", "reason": reason})


def invalid_body(message: str) -> bytes:
    """GCO: a body that is not a JSON object is ``400 {"error": "<why>"}``."""
    return json_body({"error": message})


def invalid_request(param: str, message: str) -> bytes:
    """OpenAI's shape for a request the model server would refuse, naming the field."""
    return json_body({"error": {"message": message, "type": "invalid_request_error",
                                "param": param, "code": 400}})


def model_not_found(model: str) -> bytes:
    """OpenAI's answer for a model no backend serves (its shape, param named)."""
    return json_body({"error": {
        "message": f"The model `{model}` does not exist.", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}})


def shutting_down() -> bytes:
    return json_body({"error": {"message": "shutting down", "type": "unavailable"}})


def no_decode_backend(message: str) -> bytes:
    """GCO: PD_PROXY_NO_DECODE_BACKEND_STATUS with PD_PROXY_NO_DECODE_BACKEND_MESSAGE."""
    return json_body({"error": {"message": message, "type": "no_decode_backend"}})


def prefill_failed(detail: str) -> bytes:
    return json_body({"error": {"message": f"prefill failed: {detail}",
                                "type": "prefill_failed", "code": 502}})


def prefill_target_refused(message: str) -> bytes:
    return json_body({"error": {"message": message, "type": "prefill_target_refused"}})


def decode_failed(status: int) -> bytes:
    return error_body(status, "decode backend failed before answering", "upstream_error")


def decode_timed_out() -> bytes:
    return error_body(504, "decode backend timed out", "upstream_timeout")


def bad_gateway() -> bytes:
    return error_body(502, "bad gateway", "upstream_error")


def internal_error() -> bytes:
    return error_body(500, "internal proxy error", "internal_error")


def canned_response(status: int, body: bytes, extra: bytes = b"") -> bytes:
    """A whole response written without h11, for sockets h11 can no longer serve."""
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n%s\r\n" % (status, REASONS.get(status, b""), len(body), extra)
            ) + body
