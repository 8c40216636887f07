"""Defensive parsers for the JSON a backend answers: the prefill answer and Mooncake's /query.

A backend is a peer, not a trusted part of the proxy: a broken or hostile one
may answer JSON nested past Python's recursion limit, NaN (not JSON, RFC 8259
section 6), a list where an object belongs, megabytes of it, or engine ids full
of control characters. Whatever it sends, the parsers here either return what
the proxy can safely use or raise BadAnswer, whose message is safe to log; they
never raise anything else. Pure, no I/O; the parsing itself is strict_json's.
"""

from __future__ import annotations

from typing import Any

from .._types import KV
from . import strict_json
from .strict_json import MAX_DEPTH

# A prefill answer is one token of JSON; anything larger is not one (the caller
# already reads at most this much, this bound holds whoever the caller is).
MAX_PREFILL_ANSWER_BYTES = 8 * 1024 * 1024
# A /query answer lists a few ranks; vLLM's is well under a kilobyte per rank.
MAX_QUERY_ANSWER_BYTES = 1024 * 1024
MAX_RANKS = 1024
MAX_RANK_DIGITS = 6
# vLLM's engine ids are "<uuid>_dp<rank>" (about 45 characters) unless pinned.
MAX_ENGINE_ID_CHARS = 256


class BadAnswer(ValueError):
    """A backend answer the proxy cannot use; the message names why (never the bytes)."""


def strict_loads(raw: bytes, max_bytes: int) -> Any:
    """RFC 8259 JSON of bounded size and depth, or BadAnswer."""
    if len(raw) > max_bytes:
        raise BadAnswer(f"answer larger than {max_bytes} bytes")
    try:
        return strict_json.loads(raw)
    except strict_json.TooDeep:
        raise BadAnswer(f"answer nested deeper than {MAX_DEPTH} levels") from None
    except strict_json.TooMany:
        raise BadAnswer(f"answer holds more than {strict_json.MAX_CONTAINERS} arrays and "
                        "objects") from None
    except strict_json.NotJson:
        raise BadAnswer("answer is not JSON") from None


def prefill_answer_kv(raw: bytes) -> dict[str, Any] | None:
    """The prefill answer's top-level kv_transfer_params; BadAnswer if the answer is unusable.

    None when the answer is a JSON object without usable params (absent, null,
    not an object): vLLM's Mooncake connector answers null, and decode then
    computes the prompt itself. Keys and values inside are relayed verbatim.
    """
    answer = strict_loads(raw, MAX_PREFILL_ANSWER_BYTES)
    if not isinstance(answer, dict):
        raise BadAnswer("prefill answer is not a JSON object")
    params = answer.get(KV)
    return params if isinstance(params, dict) else None


def prefill_kv_params(raw: bytes) -> dict[str, Any] | None:
    """The prefill answer's kv_transfer_params, or None for anything unusable."""
    try:
        return prefill_answer_kv(raw)
    except BadAnswer:
        return None


def query_engine_ids(raw: bytes) -> dict[str, str]:
    """Mooncake's ``GET /query`` answer as {rank: engine_id}; BadAnswer if unusable.

    A rank ends up in the prefill leg's X-data-parallel-rank header and an
    engine id in decode's JSON body and in log lines, so a rank must be a short
    decimal string and an engine id printable ASCII without whitespace. An
    entry without an engine id (not an object, empty, not a string) is skipped,
    as a rank not serving yet; text that is not safe refuses the whole answer:
    such a server is not one to pull KV from.
    """
    answer = strict_loads(raw, MAX_QUERY_ANSWER_BYTES)
    if not isinstance(answer, dict):
        raise BadAnswer("answer is not a JSON object")
    if len(answer) > MAX_RANKS:
        raise BadAnswer(f"answer lists more than {MAX_RANKS} ranks")
    engines: dict[str, str] = {}
    for rank, entry in answer.items():
        if not (0 < len(rank) <= MAX_RANK_DIGITS and rank.isascii() and rank.isdigit()):
            raise BadAnswer("a rank is not a short decimal number")
        engine_id = entry.get("engine_id") if isinstance(entry, dict) else None
        if not isinstance(engine_id, str) or not engine_id:
            continue
        if not safe_text(engine_id, MAX_ENGINE_ID_CHARS):
            raise BadAnswer(f"the engine_id of rank {rank} is not printable ASCII "
                            f"of at most {MAX_ENGINE_ID_CHARS} characters")
        engines[rank] = engine_id
    if not engines:
        raise BadAnswer("no engine_id in the answer")
    return engines


def safe_text(text: str, max_chars: int) -> bool:
    """Printable ASCII without whitespace, at most ``max_chars`` long."""
    return (0 < len(text) <= max_chars and text.isascii() and text.isprintable()
            and " " not in text)
