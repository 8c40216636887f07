"""Backends' JSON read and written again as bytes, where the proxy rewrites part of it.

Shared by the usage rewrite (usage.py) and SGLang's logprob merge
(sglang_logprobs.py): an object read leniently (None for anything else), compact
JSON that refuses a number JSON cannot carry (Python reads 1e400 as infinity,
which json.dumps would write as the bare word Infinity), and an event's data
line written again with its own line end. Pure.
"""

from __future__ import annotations

import json
from typing import Any

from .._types import Body
from .strict_json import text_of

DECODER = json.JSONDecoder()
# Built once: json.dumps with arguments builds an encoder on every call.
_FINITE_COMPACT = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def object_of(raw: bytes) -> Body | None:
    """``raw`` as a JSON object, or None (not JSON, not an object, too deep)."""
    try:
        value = DECODER.decode(text_of(raw))  # json.loads(raw), on the decoder made once
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def finite_json(value: Any) -> bytes | None:
    """``value`` as compact JSON; None when it holds a number JSON cannot write."""
    try:
        return _FINITE_COMPACT.encode(value).encode()
    except (ValueError, RecursionError):  # inf or nan (or too deep): leave the bytes
        return None


def data_line(written: bytes, line: bytes) -> bytes:
    """``line`` (an SSE data line) written again as ``written``: its CRLF's or bare
    CR's line end stays, which JSON had taken as space."""
    return b"data: " + written + line[len(line.rstrip(b"\r")):]


def skip_space(raw: bytes, position: int) -> int:
    while raw[position:position + 1] in (b" ", b"\t", b"\n", b"\r"):
        position += 1
    return position


__all__ = ["DECODER", "data_line", "finite_json", "object_of", "skip_space"]
