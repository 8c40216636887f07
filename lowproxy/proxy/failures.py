"""The failures of a leg, and what a prefill answer means: pure data, no I/O.

failure_answers.answer_failure() is the one place each Failure becomes a
metric, a log line and the client's answer.
"""

from __future__ import annotations

from typing import Any

from ..handshakes.backend_json import MAX_PREFILL_ANSWER_BYTES, BadAnswer, strict_loads
from ..handshakes.sglang_logprobs import prefill_input_logprobs
from ..handshakes.usage import cached_tokens_of, prompt_tokens_of
from ..routes import CHAT, COMPLETIONS, MESSAGES
from ..upstream.errors import UpstreamError

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
    __slots__ = ("ok", "outcome", "kv_transfer_params", "detail", "status", "body",
                 "cached_tokens", "prompt_tokens", "prompt_token_ids", "input_logprobs")

    def __init__(self, ok: bool, outcome: str, kv_transfer_params: Any = None,
                 detail: str = "", status: int = 0, body: bytes = b"") -> None:
        self.ok = ok
        self.outcome = outcome  # ok, error, timeout, rejected
        self.kv_transfer_params = kv_transfer_params
        self.detail = detail
        self.status = status
        self.body = body  # prefill's answer, kept only when it is relayed (rejected)
        self.cached_tokens: int | None = None  # what the prefill's prefix cache held
        self.prompt_tokens: int | None = None  # of a prompt this long (the hit rate's base)
        self.prompt_token_ids: Any = None  # with return_token_ids (tokenize once)
        self.input_logprobs: list[Any] | None = None  # SGLang's prompt logprobs, to merge


def prefill_outcome(status: int, raw: bytes, want_kv: bool, surface: str | None = None,
                    finish: str | None = None, logprobs: bool = False) -> PrefillResult:
    """What a prefill answer means for the decode leg (pure).

    ``want_kv``: relay, decode needs prefill's kv_transfer_params. ``surface``:
    read the prefill's cached-token figure from its usage (None: not wanted).
    ``finish`` (Mooncake, the surface): an answer whose one token ended it as
    stopped, not on the length cap, is outcome ``stopped``: Mooncake freed that
    KV at once, and the decode waiting for it would wait 480 s for nothing.
    ``logprobs`` (SGLang's /generate with return_logprob): keep the prompt
    logprobs the prefill answered, for decode's answer.
    """
    if status in REFUSED_BY_PREFILL:
        return PrefillResult(False, "rejected", detail=f"prefill refused the request ({status})",
                             status=status, body=_json_or_none(raw))
    if status in (408, 429):
        return PrefillResult(False, "error", detail=f"prefill answered {status}: it is "
                             "overloaded or timed out, not refusing the request")
    if 400 <= status < 500:
        return PrefillResult(False, "error", detail=f"prefill answered {status}: the prefill "
                             "server is misconfigured (key, path or model), not the request")
    if not 200 <= status < 300:
        return PrefillResult(False, "error", detail=f"prefill answered {status}")
    if logprobs:  # SGLang: nothing else of the answer is read
        result = PrefillResult(True, "ok")
        result.input_logprobs = prefill_input_logprobs(raw)
        return result
    if not want_kv and surface is None and finish is None:
        return PrefillResult(True, "ok")
    try:
        answer = strict_loads(raw, MAX_PREFILL_ANSWER_BYTES)
        if not isinstance(answer, dict):
            raise BadAnswer("prefill answer is not a JSON object")
    except BadAnswer as exc:
        if want_kv:  # relay: the answer was to say where the KV is, and does not
            return PrefillResult(False, "error", detail=f"unusable prefill answer: {exc}")
        answer = {}  # concurrent: the KV is where it was planned; only usage is lost
    params = answer.get("kv_transfer_params") if want_kv else None
    stopped = finish is not None and finished_stopped(finish, answer)
    result = PrefillResult(True, "stopped" if stopped else "ok",
                           params if isinstance(params, dict) else None,
                           detail="prefill's one token ended it as stopped (an EOS or stop "
                           "token): Mooncake freed its KV" if stopped else "")
    if surface is not None:
        result.cached_tokens = cached_tokens_of(surface, answer)
        result.prompt_tokens = prompt_tokens_of(surface, answer)
    result.prompt_token_ids = answer.get("prompt_token_ids")
    return result


def finished_stopped(surface: str, answer: dict[str, Any]) -> bool:
    """Whether a (prefill) answer says it ended as stopped rather than on its length cap.

    Only the stop values each surface names are taken: anything else (a shape
    not known here) is a length-capped answer, whose KV Mooncake keeps.
    """
    if surface in (CHAT, COMPLETIONS):
        choices = answer.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        return isinstance(first, dict) and first.get("finish_reason") == "stop"
    if surface == MESSAGES:
        return answer.get("stop_reason") in ("end_turn", "stop_sequence")
    # Not Responses: vLLM's "completed" status is its catch-all, a length-capped
    # answer's too in some releases, so it tells nothing for certain.
    return False


def _json_or_none(raw: bytes) -> bytes:
    """Prefill's error body when it is a non-empty JSON object (relayed as is), else b""."""
    try:
        answer = strict_loads(raw, MAX_PREFILL_ANSWER_BYTES)
    except BadAnswer:
        return b""
    return raw if isinstance(answer, dict) and answer else b""
