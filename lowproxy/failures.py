"""The failures of a leg, and what a prefill answer means: pure data, no I/O.

dispatch.answer_failure() is the one place each Failure becomes a metric, a
log line and the client's answer.
"""

from __future__ import annotations

import json
from typing import Any

from .upstream_errors import UpstreamError

# Prefill statuses that say the request itself is wrong: relayed to the client.
# Other 4xx (401, 403, 404) say the prefill is misconfigured: the failure policy.
REFUSED_BY_PREFILL = frozenset({400, 413, 422})


# -- the failure family: what went wrong, before or after the response started


class Failure(Exception):
    """A leg failed; answer_failure() turns it into a metric, a log line and an answer."""


class NoDecode(Failure):
    """No decode endpoint could be reached (all refused, in cooldown, or untrusted)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class DecodeFailed(Failure):
    """Decode accepted the connection, then failed before its response head."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(error.detail)
        self.error = error


class DecodeTimedOut(Failure):
    """PD_PROXY_DECODE_TIMEOUT_SECONDS ran out (before or after the response started)."""


class PrefillFailed(Failure):
    """The prefill leg failed under PD_PROXY_ON_PREFILL_FAILURE=error."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Truncated(Failure):
    """Decode broke off its response after it had started."""

    def __init__(self, detail: str, backend: str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.backend = backend


class PrefillRefused(Failure):
    """Prefill answered 400, 413 or 422: the request itself is wrong (a prompt over
    the context, say). The client gets prefill's status and body; decode is not
    asked to recompute what would fail the same way."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"prefill refused the request ({status})")
        self.status = status
        self.body = body


class PrefillResult:
    __slots__ = ("ok", "outcome", "kv_transfer_params", "detail", "status", "body")

    def __init__(self, ok: bool, outcome: str, kv_transfer_params: Any = None,
                 detail: str = "", status: int = 0, body: bytes = b"") -> None:
        self.ok = ok
        self.outcome = outcome  # ok, error, timeout, rejected
        self.kv_transfer_params = kv_transfer_params
        self.detail = detail
        self.status = status
        self.body = body  # prefill's answer, kept only when it is relayed (rejected)


def prefill_outcome(status: int, raw: bytes, want_kv: bool) -> PrefillResult:
    """What a prefill answer means for the decode leg (pure)."""
    if status in REFUSED_BY_PREFILL:
        return PrefillResult(False, "rejected", detail=f"prefill refused the request ({status})",
                             status=status, body=_json_or_none(raw))
    if 400 <= status < 500:
        return PrefillResult(False, "error", detail=f"prefill answered {status}: the prefill "
                             "server is misconfigured (key, path or model), not the request")
    if not 200 <= status < 300:
        return PrefillResult(False, "error", detail=f"prefill answered {status}")
    if not want_kv:
        return PrefillResult(True, "ok")
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return PrefillResult(True, "ok", kv)


def _json_or_none(raw: bytes) -> bytes:
    """Prefill's error body when it is a JSON object (relayed as is), else b""."""
    try:
        return raw if isinstance(json.loads(raw), dict) else b""
    except (ValueError, RecursionError):
        return b""
